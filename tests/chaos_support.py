"""What the chaos and fault tests share besides their system (not a test module): the run spec they
drive (`chaos_spec`), Redis's append-only file (`aof_tail_file`) and how a run's report is shown.

The system itself, every service a process that a test kills (SIGKILL), restarts and freezes
(SIGSTOP), with the bucket watched and every batch audited at the end, is
`brigade_testing.audited_system.AuditedSystem`, which the whole-system benchmarks drive too.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from brigade.spec_file import build_spec, merge_spec_data
from brigade.v1 import brigade_pb2 as pb


def chaos_spec(run_id: str, max_steps: int, **overrides: Any) -> pb.RunSpec:
    """The demo task, made as cheap as it gets: 4 prompts x 4 samples x 4 new tokens per batch,
    LoRA on two projections, short leases so a killed worker's batch comes back within seconds."""
    base: dict[str, Any] = {
        "run_id": run_id, "model": "demo", "dataset": "demo", "dtype": "float32", "device": "cpu", "seed": 7,
        "max_steps": max_steps, "prompts_per_batch": 4, "batches_per_step": 1, "eval_every": 0,
        "lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]},
        "sampling": {"group_size": 4, "max_new_tokens": 4},
        "grpo": {"learning_rate": 2e-3},
        "staleness": {"max_staleness": 2, "lease_seconds": 6, "max_attempts": 3},
        "rewards": [{"function": "demo_sum"}],
    }
    return build_spec(merge_spec_data(base, overrides))


# ---------------------------------------------------------------- Redis's append-only file


def aof_tail_file(redis_dir: Path) -> Path:
    """The file Redis appends to now: with Redis 7's multi-part AOF, the newest incr file its
    manifest names under appendonlydir (a rewrite starts a new one)."""
    folder = redis_dir / "appendonlydir"
    name = ""
    for line in (folder / "appendonly.aof.manifest").read_text().splitlines():
        fields = line.split()
        entry = dict(zip(fields[::2], fields[1::2], strict=False))
        if entry.get("type") == "i":
            name = entry["file"]
    if not name:
        raise FileNotFoundError(f"no incr file in {folder}/appendonly.aof.manifest")
    return folder / name


def show_report(capsys, text: str) -> None:
    """A run's report: in the test's captured output (pytest shows it with a failure, under
    pytest-xdist too, which drops what a worker writes past capture) and, in a plain pytest run
    (make chaos), on the terminal as well."""
    print(text)
    if "PYTEST_XDIST_WORKER" not in os.environ:
        with capsys.disabled():
            print("\n" + text, flush=True)
