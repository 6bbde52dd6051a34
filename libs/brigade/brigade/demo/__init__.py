"""The demo: a tiny model, a verifiable addition task and its reward.

Only the torch-free task module is imported here (the proxy uses it); the model builder is
`brigade.demo.build` (torch, transformers).
"""

from brigade.demo.task import (
    DEFAULT_TARGET_MODULES,
    DEMO_LORA,
    DEMO_LR,
    DEMO_PROMPTS_PER_STEP,
    DEMO_SAMPLING,
    demo_reward,
    load_prompts,
)

__all__ = [
    "DEFAULT_TARGET_MODULES",
    "DEMO_LORA",
    "DEMO_LR",
    "DEMO_PROMPTS_PER_STEP",
    "DEMO_SAMPLING",
    "demo_reward",
    "load_prompts",
]
