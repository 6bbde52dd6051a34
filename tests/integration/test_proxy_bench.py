"""Smoke test of `brigade bench proxy`: a tiny run end to end (separate proxy processes with and
without pipelining, client processes, the do-nothing gRPC floor, the raw redis-py baseline). The speed targets are read from
the full benchmark's figures, not asserted here: a shared 2-core machine is too noisy for that."""

from __future__ import annotations

import json

import pytest

from brigade_bench.proxy import run

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_bench_proxy_smoke():
    out = await run(quick=True, cycles=400, paced_seconds=0.3, paced_rate=400)
    for key in ("lease_cycles_per_s", "acquire_p50_ms", "acquire_p99_ms", "saturated_acquire_p99_ms",
                "raw_cycles_per_s", "redis_py_cycles_per_s", "cycle_ratio", "paced_cycles_per_s",
                "processes_acquire_p99_ms", "processes_cycles_per_s", "one_call_cycles_per_s", "one_call_p99_ms",
                "one_call_cpu_ms_per_cycle", "one_call_processes_p99_ms"):
        assert out[key] > 0, key
    assert 0 <= out["one_call_over_target_share"] <= 1 and out["one_call_slow_stretch_s"] >= 0
    # 1 process: closed loop, paced, light, then one call a cycle closed and paced; then 2 processes:
    # paced, closed, paced with one call
    assert out["cycles"] == 400 + 120 + 60 + 400 + 120 + 120 + 400 + 120 and out["denied"] == 0
    assert 0 < out["proxy_cpu_ms_per_cycle"] < 1000 and out["proxy_cores"] > 0   # read off the proxy's /proc
    assert out["processes_cpu_ms_per_cycle"] > 0  # the children's CPU is counted too
    # who else used the cores during the one-call phase: the client processes (their own clocks) and
    # Redis (read in 10 ms ticks: a 120-cycle phase may round to none); the machine's shares are shares
    assert out["one_call_clients_cpu_ms_per_cycle"] > 0 and out["one_call_redis_cpu_ms_per_cycle"] >= 0
    assert 0 < out["one_call_machine_busy"] <= 1 and 0 <= out["one_call_machine_steal"] <= out["one_call_machine_busy"]
    # and during the two-call phase, with the cores the phase used (proxy, clients, Redis)
    for prefix in ("", "one_call_"):
        assert out[f"{prefix}clients_cpu_ms_per_cycle"] > 0 and 0 < out[f"{prefix}machine_busy"] <= 1, prefix
        assert out[f"{prefix}phase_cores"] > 0, prefix
    # the floor: the same one-call phase against a gRPC server that does no work, its own process
    assert out["floor_one_call_p99_ms"] >= out["floor_one_call_p50_ms"] > 0 and out["floor_cpu_ms_per_cycle"] >= 0
    assert out["floor_clients_cpu_ms_per_cycle"] > 0 and 0 < out["floor_machine_busy"] <= 1
    assert out["floor_acquire_p99_ms"] > 0 and out["floor_cpu_ms_per_two_call_cycle"] >= 0
    assert out["floor_phase_cores"] > 0
    json.dumps(out)
