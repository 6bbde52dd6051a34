"""`brigade bench bucket`: the bucket library against raw aiobotocore on the same S3 server.

One 34 MiB random object (a rank-16 attention-only LoRA adapter of a 7B model in bf16) is put
and read back through `brigade.bucket` and through plain `put_object` / `get_object` +
`read()` calls, interleaved round by round so both see the same server state and noise.
Figures are medians; ratios are our time divided by the baseline's (lower is better).

`get_buffer_*` is the verified read into one preallocated buffer (`Bucket.get_buffer`, hashed from
that buffer as it fills), the read every adapter file takes: `get` returns bytes, so it keeps the
chunks and joins them after the last one, and hashes chunk by chunk.

Where a verified GET's time goes: `get_unverified_*` is the same library read without the sha256
check, `sha256_ms` the check alone (the whole object hashed at once, nothing else running), and
`sha256_hidden` the share of that check the read hides by hashing each chunk on a thread as it
arrives (1 = a verified GET costs no more than a raw one, 0 = it costs raw + sha256_ms).

How busy the machine already is: with a moto server started here (it shares this machine's
cores), `raw_get_server_cpu_ms` is the server's CPU per raw GET and `raw_get_busy` the share of
all cores the raw GET keeps busy (client and server CPU over cores x wall), an average over the
whole GET: the wait for the headers leaves a core idle, the body keeps both busy.

Where it runs: against the URL in BRIGADE_BENCH_S3 if set (endpoint and credentials from the
usual AWS environment), else against AWS_ENDPOINT_URL(_S3) with a throwaway bucket, else
against a moto server it starts and stops itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from aiobotocore.config import AioConfig
from aiobotocore.session import get_session

from brigade.bucket import open_bucket, sha256_hex
from brigade.bucket.s3 import S3Bucket
from brigade_bench.system import process_cpu_s
from brigade_harness.devservers import MOTO_ENV, start_moto

MiB = 1 << 20
SIZE_MIB = 34


@contextlib.contextmanager
def _env(values: dict[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


async def _timed(fn: Callable[[], Awaitable[Any]], server_pid: int | None) -> tuple[float, float, float | None]:
    """Wall seconds, this process's CPU seconds (all threads) and the S3 server's, when it runs
    here: CPU is the steadier figure on a shared, oversubscribed machine."""
    s0, c0, t0 = process_cpu_s(server_pid), time.process_time(), time.perf_counter()
    await fn()
    wall, cpu, s1 = time.perf_counter() - t0, time.process_time() - c0, process_cpu_s(server_pid)
    return wall, cpu, None if s0 is None or s1 is None else s1 - s0


async def _bench(url: str, rounds: int, server_pid: int | None) -> dict[str, float | int | str]:
    data = os.urandom(SIZE_MIB * MiB)
    digest = sha256_hex(data)
    run_id = uuid.uuid4().hex[:8]
    ours_key, raw_key = f"bench/{run_id}/ours.bin", f"bench/{run_id}/raw.bin"

    bucket = open_bucket(url)
    assert isinstance(bucket, S3Bucket)
    await bucket.ensure()
    # The baseline: a bare client with the same endpoint, region and checksum settings (so
    # neither side pays for CRC trailers the other skips), and no library on top.
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    config = AioConfig(
        region_name=region,
        s3={"addressing_style": "path" if endpoint else "auto"},
        request_checksum_calculation="when_required",
        response_checksum_validation="when_required",
    )
    raw_name, raw_full = bucket.name, f"{bucket.prefix}/{raw_key}" if bucket.prefix else raw_key

    times: dict[str, list[float]] = {"put": [], "get": [], "raw_put": [], "raw_get": [], "get_unverified": [],
                                     "get_buffer": [], "sha256": []}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    server_cpu: dict[str, list[float]] = {k: [] for k in times}
    async with get_session().create_client("s3", endpoint_url=endpoint, config=config) as raw:

        async def ours_put() -> None:
            assert await bucket.put(ours_key, data) == digest

        async def ours_get() -> None:
            got = await bucket.get(ours_key, sha256=digest)
            assert len(got) == len(data)

        async def ours_get_buffer() -> None:  # what adapters.read_version does with each file
            got = await bucket.get_buffer(ours_key, sha256=digest)
            assert len(got) == len(data)

        async def ours_get_unverified() -> None:  # the same read without sha256: where the gap is
            got = await bucket.get(ours_key)
            assert len(got) == len(data)

        async def sha256_alone() -> None:  # the check's own cost, on the loop, with nothing else running
            assert sha256_hex(data) == digest

        async def raw_put() -> None:
            await raw.put_object(Bucket=raw_name, Key=raw_full, Body=data)

        async def raw_get() -> None:
            resp = await raw.get_object(Bucket=raw_name, Key=raw_full)
            async with resp["Body"] as body:
                got = await body.read()
            assert len(got) == len(data)

        try:
            # One untimed round warms connections, the credential chain and the server.
            for fn in (ours_put, raw_put, ours_get, raw_get):
                await fn()
            for r in range(rounds):
                # Alternate who goes first so neither side always follows the other's GC.
                pairs = [("put", ours_put), ("raw_put", raw_put)]
                gets = [("get", ours_get), ("raw_get", raw_get), ("get_unverified", ours_get_unverified),
                        ("get_buffer", ours_get_buffer)]
                if r % 2:
                    pairs.reverse()
                    gets.reverse()
                for name, fn in (*pairs, *gets, ("sha256", sha256_alone)):
                    dt, dc, ds = await _timed(fn, server_pid)
                    times[name].append(dt)
                    cpu[name].append(dc)
                    if ds is not None:
                        server_cpu[name].append(ds)
        finally:
            await bucket.delete(ours_key)
            await raw.delete_object(Bucket=raw_name, Key=raw_full)
            await bucket.close()

    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    mb = len(data) / 1e6
    cores = os.cpu_count() or 1
    room: dict[str, float] = {}
    if server_cpu["raw_get"]:  # ticks: the mean over rounds, not a median of mostly 0 or 10 ms
        raw_server = statistics.mean(server_cpu["raw_get"])
        raw_busy_s = med_cpu["raw_get"] + raw_server
        room = {
            "raw_get_server_cpu_ms": round(raw_server * 1e3, 1),
            "get_server_cpu_ms": round(statistics.mean(server_cpu["get"]) * 1e3, 1),
            "raw_get_busy": round(raw_busy_s / (cores * med["raw_get"]), 2),
        }
    return {
        "size_mib": SIZE_MIB,
        "rounds": rounds,
        "target": url.split("://", 1)[0] + "://" + raw_name,
        "put_mb_s": round(mb / med["put"], 1),
        "get_mb_s": round(mb / med["get"], 1),
        "raw_put_mb_s": round(mb / med["raw_put"], 1),
        "raw_get_mb_s": round(mb / med["raw_get"], 1),
        "put_ms": round(med["put"] * 1e3, 1),
        "get_ms": round(med["get"] * 1e3, 1),
        "raw_put_ms": round(med["raw_put"] * 1e3, 1),
        "raw_get_ms": round(med["raw_get"] * 1e3, 1),
        "put_ratio": round(med["put"] / med["raw_put"], 3),
        "get_ratio": round(med["get"] / med["raw_get"], 3),
        "get_buffer_ms": round(med["get_buffer"] * 1e3, 1),
        "get_buffer_ratio": round(med["get_buffer"] / med["raw_get"], 3),
        "get_buffer_cpu_ms": round(med_cpu["get_buffer"] * 1e3, 1),
        "get_unverified_ms": round(med["get_unverified"] * 1e3, 1),
        "get_unverified_ratio": round(med["get_unverified"] / med["raw_get"], 3),
        "sha256_ms": round(med["sha256"] * 1e3, 1),
        # how much of the check's time the read hides: 1 = all of it (get = raw), 0 = none (get = raw + sha256)
        "sha256_hidden": round((med["raw_get"] + med["sha256"] - med["get"]) / med["sha256"], 2),
        "put_cpu_ms": round(med_cpu["put"] * 1e3, 1),
        "get_cpu_ms": round(med_cpu["get"] * 1e3, 1),
        "raw_put_cpu_ms": round(med_cpu["raw_put"] * 1e3, 1),
        "raw_get_cpu_ms": round(med_cpu["raw_get"] * 1e3, 1),
        **room,
        "cpus": cores,
    }


async def with_s3(bench: Callable[[str, int | None], Awaitable[dict]]) -> dict:
    """Run `bench(url, server_pid)` against BRIGADE_BENCH_S3, else the endpoint in
    AWS_ENDPOINT_URL(_S3) with a throwaway bucket, else a moto server started (and stopped) for the
    occasion; server_pid is that server's process id, None for a server that is not ours."""
    url = os.environ.get("BRIGADE_BENCH_S3")
    if url:
        return await bench(url, None)
    name = f"brigade-bench-{uuid.uuid4().hex[:10]}"
    if os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL"):
        return await bench(f"s3://{name}/bench", None)
    server = await asyncio.to_thread(start_moto)
    try:
        with _env({**MOTO_ENV, "AWS_ENDPOINT_URL": server.url}):
            return await bench(f"s3://{name}/bench", server.proc.pid) | {"server": "moto"}
    finally:
        server.stop()


async def run(quick: bool = False) -> dict[str, float | int | str]:
    rounds = 5 if quick else 11
    return await with_s3(lambda url, server_pid: _bench(url, rounds, server_pid))
