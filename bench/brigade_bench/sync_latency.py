"""`brigade bench sync-latency`: how long after the learner's PublishAdapter returns every rollout
worker can generate with the new adapter version, against raw GETs of the same bytes, in the
same run.

N simulated workers (4) each do what a rollout worker does between leases: their own proxy
connection subscribed to the WatchRun stream and their own `AdapterCache`
(services/rollout/brigade_rollout/adapter_cache.py) with its own bucket client, prefetching each version on
AdapterPublished (manifest, then every file sha256-checked, then decoded off the event loop, bf16
kept as sent). A version counts as synced on a worker when it lands in that worker's cache. The workers
share one process (a process each would import torch and peft, slower than the benchmark on 2
cores). The bench process plays the learner: it writes version v to the bucket (untimed, as the
learner does before publishing), calls PublishAdapter, and starts the clock when the call returns.

Baseline: the same N workers GET the same objects (manifest, weights, config, in the same order)
with their own bare aiobotocore clients at the same moment, on a signal from the bench process; the
clock starts when the signal is sent. Both sides run N fetches at once on the same machine and the
same S3 server. Each side goes first, second and last in turn.

Control: the same path with the workers' sha256 check turned off for that version (`unchecked`, a
third side taking its turn with the other two), and the CPU each side cost the watcher process and
the S3 server a round, beside what sha256 of the payload costs one core: where every core is busy
(4 workers and the S3 server on 2 cores), the check's CPU lands on every worker's wait; a real
worker hashes on cores of its own.

Figures per adapter (demo: the demo run's LoRA; 7b: rank 16 on q/k/v/o of a Llama-2-7B layout,
16.8 M parameters, 33.6 MB in bf16, the README's "~34 MB"): all_p50/all_p95 = time until every
worker has it (the slowest of the N, per round), worker_p50/p95 = each worker's own time, and the
same for raw; ratio = all_p50 / raw_all_p50 (target <= 1.25; p95 <= 1.5); notify/fetch/decode_ms split a
worker's time into the WatchRun notification, `adapters.read_version` (GETs + sha256 checks) and
the decode; busy/raw_busy = the share of the machine's cores in use while each side ran (both sides
share them with the S3 server: a side near 1 has no core left to hide its work on).
The same is then measured with one worker alone (`*_1w_*`): N workers on this 2-core machine share
cores for the CPU parts (sha256, decode) that N real workers would each do on their own machine.

S3: BRIGADE_BENCH_S3 if set, else AWS_ENDPOINT_URL(_S3) with a throwaway bucket, else a moto
server started here (single-process Python: it serves the N concurrent GETs one core at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from brigade_bench.system import Ticks, machine_ticks, percentile, progress, workdir

FULL = dict(workers=4, rounds=15)
QUICK = dict(workers=4, rounds=9)  # p50 of 5 rounds moved the ratio by +-0.1 between runs
LLAMA7B_LAYERS, LLAMA7B_HIDDEN = 32, 4096


# ---------------------------------------------------------------- adapter payloads


def seven_b_adapter(rank: int = 16) -> dict[str, bytes]:
    """PEFT-named rank-`rank` LoRA tensors on q/k/v/o of Llama-2-7B's 32 layers, random, in bf16."""
    import torch

    from brigade import adapters

    g = torch.Generator().manual_seed(0)
    state = {}
    for layer in range(LLAMA7B_LAYERS):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            state[f"{name}.lora_A.weight"] = torch.randn(rank, LLAMA7B_HIDDEN, generator=g) * 0.01
            state[f"{name}.lora_B.weight"] = torch.randn(LLAMA7B_HIDDEN, rank, generator=g) * 0.01
    config = json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                         "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}).encode()
    files, _ = adapters.encode(state, config)
    return files


def demo_adapter() -> dict[str, bytes]:
    """The demo run's adapter, as the learner publishes it (random values, real shapes and names)."""
    import torch

    from brigade import adapters
    from brigade.model import attach_lora, load_base
    from brigade_bench.fleet import fleet_spec

    spec = fleet_spec("sync-latency", sync=False, steps=0, max_staleness=4)
    model, _ = load_base(spec, torch.device("cpu"))
    model = attach_lora(model, spec)
    g = torch.Generator().manual_seed(0)
    state = {k: torch.randn(v.shape, generator=g) * 0.01 for k, v in adapters.adapter_state(model).items()}
    files, _ = adapters.encode(state, adapters.adapter_config_json(model))
    return files


# ---------------------------------------------------------------- the simulated workers (one process)


def uncheck_reads(bucket, folders: set[str]) -> None:
    """The control side: `bucket` reads every object in one of `folders` (adapter folders, as
    keys.adapter_prefix names them) without the sha256 check its caller asks for."""
    for name in ("get", "get_buffer"):  # read_version reads the manifest with get, the files with get_buffer
        setattr(bucket, name, _maybe_unchecked(getattr(bucket, name), folders))


def _maybe_unchecked(read, folders: set[str]):
    async def read_maybe_unchecked(key: str, sha256: str | None = None) -> bytes | bytearray:
        return await read(key, sha256=None if key.rsplit("/", 1)[0] + "/" in folders else sha256)

    return read_maybe_unchecked


def _raw_client():
    from aiobotocore.config import AioConfig
    from aiobotocore.session import get_session

    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"
    config = AioConfig(region_name=region, s3={"addressing_style": "path" if endpoint else "auto"},
                       request_checksum_calculation="when_required", response_checksum_validation="when_required")
    return get_session().create_client("s3", endpoint_url=endpoint, config=config)


async def _watcher_host(a: argparse.Namespace) -> None:
    """Several simulated workers in one process: for each, its own proxy connection with a WatchRun
    subscription, its own bucket client and `AdapterCache`, and its own bare S3 client for the raw
    baseline. (One process instead of one per worker: each would import torch and peft, which on a
    2-core machine takes longer than the benchmark.) Reports on stdout, one JSON object a line."""
    from brigade import adapters
    from brigade.bucket import open_bucket
    from brigade.log import configure_logging
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb
    from brigade_rollout.adapter_cache import AdapterCache

    configure_logging("rollout", "warning")

    def say(**row) -> None:
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()

    # where each worker's time goes, without touching the cache's code path: time the two calls its
    # fetch makes (the files dict read_version returns is what decode is then called with)
    fetch_s: dict[tuple[int, int], float] = {}
    files_of: dict[int, tuple[int, int]] = {}
    decode_s: dict[tuple[int, int], float] = {}
    read_version, decode = adapters.read_version, adapters.decode

    async def timed_read_version(bucket, run, version):
        t0 = time.time()
        manifest, files = await read_version(bucket, run, version)
        fetch_s[(id(bucket), version)] = time.time() - t0
        files_of[id(files)] = (id(bucket), version)
        return manifest, files

    def timed_decode(files, *args, **kwargs):
        t0 = time.time()
        try:
            return decode(files, *args, **kwargs)
        finally:
            decode_s[files_of.pop(id(files), (0, 0))] = time.time() - t0

    adapters.read_version, adapters.decode = timed_read_version, timed_decode
    unchecked: set[str] = set()  # adapter folders the workers read without their sha256 check

    class Sim:
        def __init__(self, run: str, index: int):
            self.run, self.index = run, index
            self.bucket = open_bucket(a.bucket)
            self.seen: dict[int, float] = {}
            sim = self
            uncheck_reads(self.bucket, unchecked)

            class TimedCache(AdapterCache):
                def _done(self, version: int, task: asyncio.Task) -> None:
                    super()._done(version, task)
                    if version in self:
                        key = (id(sim.bucket), version)
                        say(kind="ours", run=sim.run, worker=sim.index, v=version, t=time.time(),
                            seen=sim.seen.pop(version, float("nan")), fetch=fetch_s.pop(key, float("nan")),
                            decode=decode_s.pop(key, float("nan")))

            self.cache = TimedCache(self.bucket, run, capacity=2)
            self.client = ProxyClient.connect(a.proxy)
            self.task = asyncio.create_task(self.watch())

        async def watch(self) -> None:  # what the rollout worker's WatchRun loop does
            after = ""
            while True:
                try:
                    async for ev in self.client.runs.WatchRun(pb.WatchRunRequest(run_id=self.run, after_id=after)):
                        after = ev.id
                        if ev.type == "AdapterPublished" and ev.attrs.get("version", "").isdigit():
                            self.seen[int(ev.attrs["version"])] = time.time()
                            self.cache.prefetch(int(ev.attrs["version"]))
                except asyncio.CancelledError:
                    raise
                except Exception:
                    await asyncio.sleep(0.2)

        async def raw_get(self, raw, rid: int, keys: list[str]) -> None:
            name, prefix = self.bucket.name, self.bucket.prefix
            for key in keys:
                resp = await raw.get_object(Bucket=name, Key=f"{prefix}/{key}" if prefix else key)
                async with resp["Body"] as body:
                    await body.read()
            say(kind="raw", run=self.run, worker=self.index, id=rid, t=time.time())

        async def close(self) -> None:
            self.task.cancel()
            await self.cache.close()
            await self.client.close()
            await self.bucket.close()

    sims: dict[str, list[Sim]] = {}
    for item in a.runs.split(","):
        run, n = item.rsplit(":", 1)
        sims[run] = [Sim(run, i) for i in range(int(n))]
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    async with contextlib.AsyncExitStack() as stack:
        raws = {id(s): await stack.enter_async_context(_raw_client()) for group in sims.values() for s in group}
        say(kind="ready")
        while line := await reader.readline():
            cmd = json.loads(line)
            if "unchecked" in cmd:
                unchecked.add(cmd["unchecked"])
                say(kind="ack", folder=cmd["unchecked"])
                continue
            await asyncio.gather(*(s.raw_get(raws[id(s)], cmd["id"], cmd["keys"]) for s in sims[cmd["run"]]))
    for group in sims.values():
        for s in group:
            await s.close()


# ---------------------------------------------------------------- the bench


class Watchers:
    """The watcher host process; its JSON lines arrive on one queue."""

    def __init__(self, proxy: str, bucket: str, runs: dict[str, int], env: dict[str, str], logs: Path):
        self.proxy, self.bucket, self.runs, self.env, self.logs = proxy, bucket, runs, env, logs
        self.proc: asyncio.subprocess.Process | None = None
        self.lines: asyncio.Queue[dict] = asyncio.Queue()
        self._reader: asyncio.Task | None = None

    async def spawn(self) -> None:
        runs = ",".join(f"{run}:{n}" for run, n in self.runs.items())
        log = (self.logs / "watchers.log").open("ab")
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "brigade_bench.sync_latency", "watchers", "--proxy", self.proxy,
            "--bucket", self.bucket, "--runs", runs, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=log, env=self.env)
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        while line := await self.proc.stdout.readline():
            self.lines.put_nowait(json.loads(line))
        self.lines.put_nowait({"kind": "exit", "code": await self.proc.wait()})

    async def ready(self) -> None:
        await self.collect("ready", 1, timeout=180)

    async def collect(self, kind: str, n: int, match: dict | None = None, timeout: float = 60) -> list[dict]:
        got: list[dict] = []
        deadline = time.monotonic() + timeout
        while len(got) < n:
            row = await asyncio.wait_for(self.lines.get(), max(0.01, deadline - time.monotonic()))
            if row["kind"] == "exit":
                raise RuntimeError(f"the watcher process exited with {row['code']}; see {self.logs}/watchers.log")
            if row["kind"] == kind and all(row.get(k) == v for k, v in (match or {}).items()):
                got.append(row)
        return got

    async def raw(self, run: str, rid: int, keys: Sequence[str]) -> float:
        t0 = time.time()
        self.proc.stdin.write((json.dumps({"run": run, "id": rid, "keys": list(keys)}) + "\n").encode())
        await self.proc.stdin.drain()
        return t0

    async def uncheck(self, folder: str) -> None:
        """The workers read the adapter in `folder` without the sha256 check (the control side)."""
        self.proc.stdin.write((json.dumps({"unchecked": folder}) + "\n").encode())
        await self.proc.stdin.drain()
        await self.collect("ack", 1, {"folder": folder})

    async def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()
        if self._reader is not None:
            self._reader.cancel()


def _figures(name: str, ours: list[list[float]], raw: list[list[float]], size: int) -> dict:
    all_ours = [max(r) for r in ours]
    all_raw = [max(r) for r in raw]
    each_ours = [x for r in ours for x in r]
    each_raw = [x for r in raw for x in r]
    ms = lambda x: round(x * 1e3, 1)  # noqa: E731
    return {
        f"{name}_mib": round(size / 2**20, 2),
        f"{name}_all_p50_ms": ms(percentile(all_ours, 0.5)), f"{name}_all_p95_ms": ms(percentile(all_ours, 0.95)),
        f"{name}_raw_all_p50_ms": ms(percentile(all_raw, 0.5)), f"{name}_raw_all_p95_ms": ms(percentile(all_raw, 0.95)),
        f"{name}_worker_p50_ms": ms(percentile(each_ours, 0.5)),
        f"{name}_worker_p95_ms": ms(percentile(each_ours, 0.95)),
        f"{name}_raw_worker_p50_ms": ms(percentile(each_raw, 0.5)),
        f"{name}_raw_worker_p95_ms": ms(percentile(each_raw, 0.95)),
        f"{name}_ratio": round(percentile(all_ours, 0.5) / percentile(all_raw, 0.5), 3),
        f"{name}_p95_ratio": round(percentile(all_ours, 0.95) / percentile(all_raw, 0.95), 3),
    }


def _control(name: str, s: dict) -> dict:
    """Where the time over raw goes: the same path with the sha256 check off (`unchecked`), the CPU
    each side cost the watcher process (every simulated worker) and the S3 server a round, and what
    the sha256 of the payload costs one core. Where the cores are all busy, the check adds its CPU
    to every worker's wait."""
    ms = lambda x: round(x, 1)  # noqa: E731
    unchecked = percentile([max(r) for r in s["unchecked"]], 0.5)
    (client, server), (u_client, u_server), (r_client, r_server) = (s["cpu_ms"][side] for side in SIDES)
    return {
        f"{name}_unchecked_all_p50_ms": ms(unchecked * 1e3),
        f"{name}_unchecked_ratio": round(unchecked / percentile([max(r) for r in s["raw"]], 0.5), 3),
        f"{name}_client_cpu_ms": ms(client), f"{name}_unchecked_client_cpu_ms": ms(u_client),
        f"{name}_raw_client_cpu_ms": ms(r_client),
        f"{name}_s3_cpu_ms": ms(server), f"{name}_unchecked_s3_cpu_ms": ms(u_server), f"{name}_raw_s3_cpu_ms": ms(r_server),
        f"{name}_sha256_ms": ms(s["sha256_ms"]),
        # fresh pages the watcher process touched a round: a new buffer's page faults are CPU too
        **{f"{name}_{side}_faults".replace("_ours", ""): round(s["faults"][side]) for side in SIDES},
    }


def _add_ticks(acc: list[int], before: Ticks | None, after: Ticks | None) -> None:
    if before is not None and after is not None:
        acc[0] += after.busy - before.busy
        acc[1] += after.total - before.total


SIDES = ("ours", "unchecked", "raw")


async def _measure(client, bucket, run: str, n: int, watchers: Watchers, payloads: dict[str, dict[str, bytes]],
                   rounds: int, s3_pid: int | None) -> dict[str, dict]:
    """Publish-to-cached times (with and without the sha256 check) and raw GET times, per round and
    worker, for each payload; and the CPU the watcher process and the S3 server spent on each side."""
    from brigade import adapters, keys
    from brigade.v1 import brigade_pb2 as pb

    version, rid = 0, 0
    series: dict[str, dict] = {}
    for name, files in payloads.items():
        times: dict[str, list[list[float]]] = {side: [] for side in SIDES}
        parts: list[dict[str, float]] = []
        ticks = {side: [0, 0] for side in SIDES}  # the machine's busy and total ticks while each side ran
        cpu = {side: [0.0, 0.0, 0.0] for side in SIDES}  # the watcher's and the S3 server's CPU s, the watcher's faults
        for r in range(rounds + 1):  # round 0 warms subscriptions, connections and the server
            for side in SIDES[r % 3:] + SIDES[:r % 3]:  # each side goes first, second and last in turn
                if side == "raw":
                    rid += 1
                    prefix = keys.adapter_prefix(run, version)
                    tick0, cpu0 = machine_ticks(), _cpu(watchers, s3_pid)
                    t0 = await watchers.raw(run, rid, [prefix + f for f in (adapters.MANIFEST, *sorted(files))])
                    rows = await watchers.collect("raw", n, {"id": rid})
                else:
                    version += 1
                    if side == "unchecked":
                        await watchers.uncheck(keys.adapter_prefix(run, version))
                    manifest = await adapters.write_version(bucket, run, version, version, files, "bf16")
                    tick0, cpu0 = machine_ticks(), _cpu(watchers, s3_pid)
                    await client.learner.PublishAdapter(pb.PublishAdapterRequest(run_id=run, manifest=manifest),
                                                        timeout=30)
                    t0 = time.time()
                    rows = await watchers.collect("ours", n, {"run": run, "v": version})
                    if r and side == "ours":
                        parts.extend({"notify": row["seen"] - t0, "fetch": row["fetch"], "decode": row["decode"]}
                                     for row in rows)
                _add_ticks(ticks[side], tick0, machine_ticks())
                if r:
                    times[side].append([row["t"] - t0 for row in rows])
                    cpu[side] = [x + (b - a if a is not None and b is not None else float("nan"))
                                 for x, a, b in zip(cpu[side], cpu0, _cpu(watchers, s3_pid), strict=True)]
        series[name] = {**times, "parts": parts, "size": sum(len(b) for b in files.values()),
                        "busy": {side: busy / total if total else float("nan") for side, (busy, total) in ticks.items()},
                        "cpu_ms": {side: [1e3 * x / rounds for x in cpu[side][:2]] for side in SIDES},
                        "faults": {side: cpu[side][2] / rounds for side in SIDES},
                        "sha256_ms": _sha256_ms(files)}
    return series


def _cpu(watchers: Watchers, s3_pid: int | None) -> tuple[float | None, float | None, int | None]:
    from brigade_bench.system import process_cpu_s, process_minor_faults

    return process_cpu_s(watchers.proc.pid), process_cpu_s(s3_pid), process_minor_faults(watchers.proc.pid)


def _sha256_ms(files: dict[str, bytes]) -> float:
    """What checking every file of the payload costs one core: the best of 3 sha256 passes."""
    import hashlib

    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for data in files.values():
            hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - t0)
    return 1e3 * best


async def _bench(url: str, cfg: dict, env: dict[str, str], root: Path, s3_pid: int | None) -> tuple[dict, dict]:
    from brigade.bucket import open_bucket
    from brigade.rpc import ProxyClient
    from brigade.spec_file import build_spec
    from brigade_harness.system import LocalSystem, create_run

    progress("sync-latency", "starting redis and the proxy")
    system = LocalSystem(root, bucket=url, env=dict(env, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))
    bucket = open_bucket(url)
    series: dict[int, dict[str, dict]] = {}
    watchers = None
    try:
        system.start_servers()
        system.start_proxy()
        proxy = system.proxy
        await bucket.ensure()
        # the fleet (N workers fetching at once), then one worker alone: the per-worker path without N
        # workers sharing this machine's cores for sha256 and decode. Each set watches its own run, so
        # the lone worker idles while the fleet is measured. The watchers start while the adapters build.
        runs = {n: f"sync-latency-{n}w-{uuid.uuid4().hex[:8]}" for n in (cfg["workers"], 1)}
        for run in runs.values():
            await create_run(proxy, "", build_spec({"run_id": run, "model": "demo", "eval_every": 0}))
        watchers = Watchers(proxy, url, {run: n for n, run in runs.items()}, system.service_env(), system.logs)
        await watchers.spawn()
        progress("sync-latency", "building the adapters")
        payloads = {"demo": demo_adapter(), "7b": seven_b_adapter()}
        await watchers.ready()
        async with ProxyClient.connect(proxy) as client:
            for n, run in runs.items():
                progress("sync-latency", f"measuring with {n} worker{'s' if n > 1 else ''}")
                series[n] = await _measure(client, bucket, run, n, watchers, payloads, cfg["rounds"], s3_pid)
    finally:
        if watchers is not None:
            await watchers.stop()
        await bucket.close()
        system.close()
    out: dict = {"workers": cfg["workers"], "rounds": cfg["rounds"]}
    for name, s in series[cfg["workers"]].items():
        out |= _figures(name, s["ours"], s["raw"], s["size"])
        for part in ("notify", "fetch", "decode"):  # each worker's own phases, medians
            out[f"{name}_{part}_ms"] = round(percentile([p[part] for p in s["parts"]], 0.5) * 1e3, 1)
        # how much of the machine's cores each side kept busy (this machine also runs the S3 server)
        out[f"{name}_busy"], out[f"{name}_raw_busy"] = round(s["busy"]["ours"], 2), round(s["busy"]["raw"], 2)
        out |= _control(name, s)
    for name, s in series[1].items():
        lone = _figures(name, s["ours"], s["raw"], s["size"])
        out |= {f"{name}_1w_p50_ms": lone[f"{name}_all_p50_ms"], f"{name}_1w_raw_p50_ms": lone[f"{name}_raw_all_p50_ms"],
                f"{name}_1w_ratio": lone[f"{name}_ratio"]}
        for part in ("fetch", "decode"):
            out[f"{name}_1w_{part}_ms"] = round(percentile([p[part] for p in s["parts"]], 0.5) * 1e3, 1)
        out |= {k.replace(f"{name}_", f"{name}_1w_", 1): v for k, v in _control(name, s).items()
                if not k.endswith("sha256_ms")}
    return out, series[cfg["workers"]]


def _plot(out_dir: Path, series: dict, quick: bool) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(series), figsize=(5 * len(series), 3.6))
    for ax, (name, s) in zip(axes, series.items(), strict=True):
        data = [[max(r) * 1e3 for r in s["ours"]], [max(r) * 1e3 for r in s["raw"]],
                [x * 1e3 for r in s["ours"] for x in r], [x * 1e3 for r in s["raw"] for x in r]]
        ax.boxplot(data, showfliers=True)
        ax.set_xticks([1, 2, 3, 4], ["publish ->\nall cached", "raw GET\nall", "publish ->\neach cached",
                                     "raw GET\neach"], fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(f"{name} adapter ({s['size'] / 2**20:.2f} MiB), {len(s['ours'][0]) if s['ours'] else 0} workers",
                     fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    fig.suptitle("adapter sync latency vs raw GET of the same bytes" + (" [quick]" if quick else ""))
    fig.tight_layout()
    path = out_dir / "sync_latency.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


def run(quick: bool = False, out_dir: str | Path | None = None) -> dict:
    from brigade_bench.bucket import _env
    from brigade_bench.fleet import out_dir_default
    from brigade_harness.devservers import MOTO_ENV, start_moto

    cfg = QUICK if quick else FULL
    out = Path(out_dir) if out_dir is not None else out_dir_default()
    server = None
    progress("sync-latency", "starting")
    url = os.environ.get("BRIGADE_BENCH_S3")
    if not url:
        url = f"s3://brigade-bench-{uuid.uuid4().hex[:10]}/bench"
        if not (os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")):
            server = start_moto()
    try:
        extra = {**MOTO_ENV, "AWS_ENDPOINT_URL": server.url} if server else {}
        with _env(extra), workdir("brigade-bench-sync-") as tmp:
            result, series = asyncio.run(_bench(url, cfg, dict(os.environ), Path(tmp),
                                                server.proc.pid if server else None))
    finally:
        if server is not None:
            server.stop()
    result["s3"] = "moto" if server else url.split("/")[2]
    result["quick"] = quick
    result["plot"] = _plot(out, series, quick)
    progress("sync-latency", "done")
    return result


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m brigade_bench.sync_latency")
    p.add_argument("role", choices=["watchers"])
    p.add_argument("--proxy", required=True)
    p.add_argument("--bucket", required=True)
    p.add_argument("--runs", required=True, help="run:workers,run:workers")
    a = p.parse_args(argv)
    asyncio.run(_watcher_host(a))


if __name__ == "__main__":
    main()
