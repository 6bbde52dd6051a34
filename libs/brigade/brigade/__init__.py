"""brigade: asynchronous GRPO on LoRA adapters. This is the shared library every service imports:
the run spec, the Redis store, the bucket, gRPC plumbing, model, adapter and rollout formats, and the
generation engines. Services live in services/<name>/brigade_<name>, the launcher in brigade_cli."""
