"""Smoke test of `brigade bench create-stall`: honest AcquireLease calls with and without the largest
CreateRun calls in flight, on a proxy shrunk to 20,000 prompts and 1 MiB messages so it takes seconds.
The stall bound is read from the full benchmark's figures, not asserted here (a shared 2-core machine
is too noisy for a timing assertion)."""

from __future__ import annotations

import json

import pytest

from brigade_bench.create_stall import run

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_bench_create_stall_smoke():
    out = await run(quick=True, max_prompts=20_000, max_message_mib=1, baseline_s=0.5)
    for key in ("baseline_p50_ms", "baseline_p99_ms", "loaded_p50_ms", "loaded_p99_ms", "loaded_max_ms",
                "stall_p99_ratio", "create_accepted_s", "create_refused_s"):
        assert out[key] > 0, key
    assert out["baseline_calls"] > 10 and out["loaded_calls"] > 0
    # the accepted maximum is created; a message full of empty prompts is refused for its count
    assert out["create_codes"] == "OK,OK,INVALID_ARGUMENT,INVALID_ARGUMENT"
    json.dumps(out)
