"""Smoke test of `brigade bench bucket --quick`: it runs end to end against a real S3 API and
returns the flat dict the CLI prints. (Speed targets are checked by reading its figures, not
here: a shared CI machine is too noisy to assert on a 10% margin.)"""

from __future__ import annotations

import json

import pytest

from brigade_bench.bucket import run

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_bench_bucket_quick() -> None:
    out = await run(quick=True)
    for key in ("size_mib", "rounds", "put_mb_s", "get_mb_s", "raw_put_mb_s", "raw_get_mb_s", "put_ratio", "get_ratio"):
        assert key in out, key
    assert out["size_mib"] == 34 and out["rounds"] == 3 and out["get_cpu_ms"] > 0
    assert all(out[k] > 0 for k in ("put_mb_s", "get_mb_s", "raw_put_mb_s", "raw_get_mb_s", "put_ratio", "get_ratio"))
    json.dumps(out)  # flat and JSON-serialisable, as `--json` prints it
