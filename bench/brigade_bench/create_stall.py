"""`brigade bench create-stall`: does a maximal CreateRun stall everyone else's calls?

One proxy process (default limits) on a fresh Redis. Honest clients call AcquireLease at a steady
rate on a small run, and each call's latency is recorded. Phase `baseline`: nothing else runs.
Phase `loaded`: meanwhile another process sends the largest CreateRun calls the proxy takes, as many
at once as it admits (`max_create_runs`): `max_prompts` prompts each (accepted: parsed, checked and
stored), then as many empty prompts as `max_message_bytes` holds (refused for their count: what a
token holder can make the proxy parse). The figure is the honest AcquireLease p99 in the loaded
phase over the baseline's, both measured in the same run; `loaded_max_ms` is the longest call.

The big requests are built as bytes (a repeated field of empty messages is `12 00` per prompt) and
sent with an identity serializer from their own process, so the client's own work never shows in
the honest clients' latencies.
"""

from __future__ import annotations

import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

FULL_REPEAT = 3
RATE = 200.0  # honest AcquireLease calls per second, in all
CLIENTS = 4


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q * (len(values) - 1))))]


def _big_request(run: str, prompts: int, text: bool, max_bytes: int = 0) -> bytes:
    """A serialized CreateRunRequest: a valid spec and `prompts` prompts (each with an id and a text
    when `text`, else empty; with `max_bytes`, as many empty ones as fit in it)."""
    from brigade.spec_file import build_spec
    from brigade.v1 import brigade_pb2 as pb

    spec = build_spec({"run_id": run, "prompts_per_batch": 8, "batches_per_step": 1})
    head = pb.CreateRunRequest(spec=spec).SerializeToString()
    if not text:
        return head + b"\x12\x00" * (prompts or (max_bytes - len(head) - 1024) // 2)
    parts = []
    for i in range(prompts):
        body = pb.Prompt(id=str(i), text="1 + 1 =").SerializeToString()
        parts.append(b"\x12" + bytes([len(body)]) + body)  # each under 128 bytes: a one-byte length
    return head + b"".join(parts)


def _flood_main() -> None:
    """The CreateRun process: `python -c ... target max_prompts max_bytes calls`; prints a JSON line
    of each call's seconds and status."""
    import json

    import grpc

    target, max_prompts, max_bytes, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    # the accepted maximum (max_prompts prompts), then a refused one (as many empty prompts as fit)
    requests = [_big_request(f"bench-stall-{i}", max_prompts, text=True) for i in range(calls)]
    requests += [_big_request(f"bench-stall-over-{i}", 0, text=False, max_bytes=max_bytes) for i in range(calls)]

    print("ready", flush=True)

    async def main() -> list:
        async with grpc.aio.insecure_channel(target, options=[("grpc.max_send_message_length", -1),
                                                              ("grpc.max_receive_message_length", -1)]) as ch:
            call = ch.unary_unary("/brigade.v1.RunService/CreateRun", request_serializer=None,
                                  response_deserializer=None)

            async def one(data: bytes) -> tuple[float, str]:
                t0 = time.perf_counter()
                try:
                    await call(data, timeout=120)
                    code = "OK"
                except grpc.aio.AioRpcError as e:
                    code = e.code().name
                return time.perf_counter() - t0, code

            out = []
            for group in (requests[:calls], requests[calls:]):
                out += await asyncio.gather(*(one(d) for d in group))
            return out

    print(json.dumps(asyncio.run(main())), flush=True)


async def _honest(target: str, run: str, stop: asyncio.Event, rate: float = RATE) -> list[float]:
    """AcquireLease latencies (ms) at `rate` calls/s from CLIENTS clients until `stop`."""
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    latencies: list[float] = []
    async with ProxyClient.connect(target) as client:
        request = pb.AcquireLeaseRequest(run_id=run, worker_id="honest", capacity_class="spot", engine="hf")
        await client.lease.AcquireLease(request, timeout=30)  # the connection is up before the clock starts

        async def loop(k: int) -> None:
            period = CLIENTS / rate
            start = time.perf_counter() + k * period / CLIENTS
            i = 0
            while not stop.is_set():
                due = start + i * period
                i += 1
                if (wait := due - time.perf_counter()) > 0:
                    await asyncio.sleep(wait)
                t0 = time.perf_counter()
                await client.lease.AcquireLease(request, timeout=60)
                latencies.append((time.perf_counter() - t0) * 1000)

        await asyncio.gather(*(loop(k) for k in range(CLIENTS)))
    return latencies


def _summary(prefix: str, ms: list[float]) -> dict:
    return {f"{prefix}_p50_ms": round(_percentile(ms, 0.5), 2), f"{prefix}_p99_ms": round(_percentile(ms, 0.99), 2),
            f"{prefix}_max_ms": round(max(ms), 2) if ms else float("nan"), f"{prefix}_calls": len(ms)}


async def run(quick: bool = False, max_prompts: int = 0, max_message_mib: int = 0, baseline_s: float = 0.0) -> dict:
    """The figures; `max_prompts`/`max_message_mib` (0 = the proxy's defaults) shrink the smoke test."""
    import json
    import os
    import subprocess

    from brigade_bench.proxy import _create_run, _stop
    from brigade_harness.devservers import free_port, start_redis, wait_for_port
    from brigade_proxy.limits import MIB, Limits

    defaults = Limits()
    max_prompts = max_prompts or defaults.max_prompts
    max_bytes = (max_message_mib * MIB) if max_message_mib else defaults.max_message_bytes
    calls = defaults.max_create_runs
    baseline_s = baseline_s or (3.0 if quick else 10.0)
    with tempfile.TemporaryDirectory(prefix="brigade-bench-stall-") as tmp:
        redis = start_redis(Path(tmp) / "redis")
        port = free_port()
        env = dict(os.environ, BRIGADE_LOG_FORMAT="json", BRIGADE_MAX_PROMPTS=str(max_prompts),
                   BRIGADE_MAX_MESSAGE_BYTES=str(max_bytes),
                   BRIGADE_MAX_REQUEST_BYTES=str(min(defaults.max_request_bytes, max_bytes)))
        proxy = subprocess.Popen([sys.executable, "-m", "brigade_proxy", "--listen", f"127.0.0.1:{port}",
                                  "--redis-url", redis.url, "--bucket", "", "--log-level", "warning"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_for_port(port, timeout=30, proc=proxy)
            target = f"127.0.0.1:{port}"
            await _create_run(target, "bench-stall-honest", 1000)
            stop = asyncio.Event()
            honest = asyncio.ensure_future(_honest(target, "bench-stall-honest", stop))
            await asyncio.sleep(baseline_s)
            stop.set()
            baseline = await honest

            stop = asyncio.Event()
            code = "from brigade_bench.create_stall import _flood_main; _flood_main()"
            flood = await asyncio.create_subprocess_exec(sys.executable, "-c", code, target, str(max_prompts),
                                                         str(max_bytes), str(calls), stdout=asyncio.subprocess.PIPE)
            # the flood process builds its requests first (seconds); the honest clients start once it sends
            await flood.stdout.readline()
            honest = asyncio.ensure_future(_honest(target, "bench-stall-honest", stop))
            out, _ = await flood.communicate()
            stop.set()
            loaded = await honest
            if flood.returncode != 0:
                raise RuntimeError(f"the CreateRun process failed ({flood.returncode})")
            creates = json.loads(out.decode().strip().splitlines()[-1])
        finally:
            _stop(proxy)
            redis.stop()
    result = {"max_prompts": max_prompts, "max_message_bytes": max_bytes, "create_runs_at_once": calls}
    result |= _summary("baseline", baseline) | _summary("loaded", loaded)
    result["stall_p99_ratio"] = round(result["loaded_p99_ms"] / result["baseline_p99_ms"], 2)
    result["create_accepted_s"] = round(max(s for s, _ in creates[:calls]), 2)
    result["create_refused_s"] = round(max(s for s, _ in creates[calls:]), 2)
    result["create_codes"] = ",".join(c for _, c in creates)
    result["baseline_mean_ms"] = round(statistics.fmean(baseline), 2)
    return result
