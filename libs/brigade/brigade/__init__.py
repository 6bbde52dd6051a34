"""brigade: asynchronous GRPO on LoRA adapters. This is the shared library every service imports:
the run spec, the Redis store, the bucket, gRPC plumbing, model, adapter and rollout formats, and the
generation engines. Services live in services/<name>/brigade_<name>, the launcher in brigade_cli."""

# TRL's front door (brigade.grpo), loaded on first use: the proxy and `ctl` import brigade and
# need none of it
_FRONT_DOOR = ("GRPOConfig", "GRPOTrainer")


def __getattr__(name: str):
    if name in _FRONT_DOOR:  # brigade.grpo imports brigade's modules, so it loads after this package
        import importlib

        return getattr(importlib.import_module("brigade.grpo"), name)
    raise AttributeError(f"module 'brigade' has no attribute {name!r}")
