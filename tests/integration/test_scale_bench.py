"""Smoke test of `brigade bench scale`'s in-process parts (janitor passes, the synthetic batch
driver) at tiny sizes, and of its curve fit. The proxy-process parts share `brigade bench proxy`'s
client code, smoke-tested in test_proxy_bench.py; figures and targets live in the benchmark."""

from __future__ import annotations

import math

import pytest

from brigade_bench.scale import _batches_part, _janitor_part, fit_exponent
from brigade_harness.devservers import start_redis


def test_fit_exponent():
    xs = [10, 100, 1000]
    assert fit_exponent(xs, [3 * x for x in xs]) == pytest.approx(1.0)
    assert fit_exponent(xs, [5.0, 5.0, 5.0]) == pytest.approx(0.0)
    assert fit_exponent(xs, [x ** 2 for x in xs]) == pytest.approx(2.0)
    assert math.isnan(fit_exponent([10], [1.0]))


@pytest.mark.asyncio(loop_scope="session")
async def test_janitor_and_batch_parts_at_tiny_sizes(tmp_path):
    redis = start_redis(tmp_path / "redis")
    try:
        j = await _janitor_part(redis.url, (50, 200))
        assert j["janitor_expire_1pct_leases"] == 2  # 1 % of 200 due, all taken back
        assert j["janitor_sweep_redis_ms_at_200_leases"] >= 0 and j["janitor_sweep_wall_ms_at_200_leases"] > 0
        b = await _batches_part(redis.url, (100, 300))
        assert 0 < b["run_bytes_at_100_batches"] < b["run_bytes_at_300_batches"]
        assert b["redis_bytes_per_finished_batch"] > 0 and b["driver_batches_per_s"] > 0
    finally:
        redis.stop()
