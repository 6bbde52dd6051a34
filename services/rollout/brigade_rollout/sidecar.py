"""What a worker writes beside each rollout object: the text sidecar (prompts, completions and
rewards as JSON, for people and tools that do not read tensors) and the manifest's reward mean."""

from __future__ import annotations

import json
import math

from brigade.datasets import prompt_value
from brigade.engine.base import Sample
from brigade.rewards import Scores
from brigade.v1 import brigade_pb2 as pb


def text_sidecar(lease: pb.Lease, worker_id: str, samples: list[Sample], completions: list[str],
                 totals: list[float | None], parts: list[list[float | None]], names: list[str],
                 scores: Scores | None = None) -> bytes:
    prompts = lease.batch.prompts
    extra = scores.extra if scores else {}
    rows = [
        {"group": s.group, "prompt_id": prompts[s.group].id, "prompt": prompt_value(prompts[s.group]),
         "completion": text, "reward": total, "reward_parts": dict(zip(names, [col[i] for col in parts], strict=True)),
         "finished": s.finished, "num_tokens": len(s.completion_ids),
         **({"extra": {k: v[i] for k, v in extra.items()}} if extra else {})}
        for i, (s, text, total) in enumerate(zip(samples, completions, totals, strict=True))
    ]
    doc = {"run_id": lease.run_id, "batch_id": lease.batch.batch_id, "attempt": lease.attempt,
           "policy_version": lease.adapter_version, "worker_id": worker_id, "reward_names": names,
           "rejected": scores.rejected if scores else {}, "samples": rows}
    return json.dumps(doc, indent=1).encode()


def reward_mean(values: list[float | None]) -> float:
    """Mean over scored samples; 0 when none was (the proxy wants a finite number, and the learner
    drops unscored samples by their NaN reward anyway)."""
    scored = [v for v in values if v is not None and math.isfinite(v)]
    return sum(scored) / len(scored) if scored else 0.0
