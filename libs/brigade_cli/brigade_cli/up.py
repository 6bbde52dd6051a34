"""`brigade up`: the whole system on one machine, each service its own process.

Redis (the one at BRIGADE_REDIS_URL if it answers, else a redis-server of our own), the bucket (a
local folder unless BRIGADE_BUCKET says otherwise), proxy, janitor, learner, N rollout workers and
the evaluator. Shows progress, restarts a service that dies (MAX_RESTARTS times each; each one
resumes from Redis and the bucket), stops everything it started on exit or Ctrl-C, and leaves
summary.json, metrics.jsonl, plots and logs in the run's output folder.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import typer

from brigade import options

# restarts per service before `up` gives up: a process that keeps dying is broken, not unlucky
MAX_RESTARTS = 3


@dataclass
class Child:
    name: str
    argv: list[str]
    log: Path
    proc: subprocess.Popen | None = None
    restarts: int = 0

    def start(self, env: dict[str, str]) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        # own process group: Ctrl-C in the terminal reaches `up`, which then stops children in order
        self.proc = subprocess.Popen(self.argv, env=env, stdout=self.log.open("ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def crashed(self) -> bool:
        """Exited, and not with 0 (a learner after max_steps, a worker after the run finished)."""
        return self.proc is not None and self.proc.poll() not in (None, 0)

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Fleet:
    env: dict[str, str]
    children: list[Child] = field(default_factory=list)

    def spawn(self, name: str, args: list[str], logs: Path) -> Child:
        child = Child(name, [sys.executable, "-m", "brigade_cli.main", *args], logs / f"{name}.log")
        child.start(self.env)
        self.children.append(child)
        return child

    def restart_crashed(self, max_restarts: int) -> str | None:
        """Start again every child that died: each service resumes where its state (Redis, the
        bucket) says, which is the point of the design. Returns an error when one keeps dying."""
        for child in self.children:
            if not child.crashed():
                continue
            rc = child.proc.returncode
            if child.restarts >= max_restarts:
                return f"{child.name} exited with {rc} {child.restarts + 1} times; its log: {child.log}"
            child.restarts += 1
            typer.echo(f"{child.name} exited with {rc}: restarting it ({child.restarts}/{max_restarts})", err=True)
            child.start(self.env)
        return None

    def stop_all(self) -> None:
        # workers first (they requeue their leases), the learner, then the coordination layer
        order = {"rollout": 0, "evaluator": 0, "learner": 1, "janitor": 2, "proxy": 3}
        for child in sorted(self.children, key=lambda c: order.get(c.name.split("-")[0], 0)):
            child.stop()


def redis_answers(url: str) -> bool:
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except (redis.RedisError, OSError, ValueError):
        return False


def demo_overrides() -> dict:
    """The demo run: the demo model and task, with the hyperparameters verified to climb."""
    from brigade.demo.task import DEMO_RUN

    return dict(DEMO_RUN)


async def wait_for_proxy(proxy: str, token: str, timeout: float = 30.0) -> None:
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    deadline = time.monotonic() + timeout
    async with ProxyClient.connect(proxy, token) as client:
        while True:
            try:
                await client.runs.ListRuns(pb.ListRunsRequest(), timeout=1)
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


async def create_run(proxy: str, token: str, spec) -> None:
    from brigade.datasets import load_prompts
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    async with ProxyClient.connect(proxy, token) as client:
        await client.runs.CreateRun(pb.CreateRunRequest(spec=spec, prompts=load_prompts(spec.dataset), exist_ok=True),
                                    timeout=30)


async def poll_metrics(proxy: str, token: str, run: str) -> tuple[list[dict], object, int]:
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    async with ProxyClient.connect(proxy, token) as client:
        metrics = await client.runs.GetMetrics(pb.GetMetricsRequest(run_id=run), timeout=5)
        state = await client.runs.GetRun(pb.RunRef(run_id=run), timeout=5)
        workers = await client.runs.ListWorkers(pb.RunRef(run_id=run), timeout=5)
    now_ms = time.time() * 1000
    live = sum(1 for w in workers.workers if now_ms - w.last_seen_ms < 30_000)
    return [json.loads(s.metrics_json) for s in metrics.steps if s.metrics_json], state, live


def progress_line(m: dict, live_workers: int, samples_per_s: float) -> str:
    return (f"step {m.get('step', 0):>4}  reward {m.get('reward_mean', float('nan')):.3f}  "
            f"kl {m.get('kl', 0.0):.4f}  staleness {m.get('staleness_mean', 0.0):.2f}  "
            f"rejected {m.get('rejection_rate', 0.0):.1%}  workers {live_workers}  {samples_per_s:.1f} samples/s")


def summarize(run: str, metrics: list[dict], state, wall_s: float) -> dict:
    rewards = [m["reward_mean"] for m in metrics if m.get("reward_mean") is not None]
    stal = [m.get("staleness_mean", 0.0) for m in metrics]
    return {
        "run": run,
        "steps": len(metrics),
        "wall_s": round(wall_s, 1),
        "samples": int(sum(m.get("accepted_samples", 0) for m in metrics)),
        "rejected": int(state.rejected + state.stale_removed) if state is not None else 0,
        "first20_reward": sum(rewards[:20]) / max(1, len(rewards[:20])),
        "last20_reward": sum(rewards[-20:]) / max(1, len(rewards[-20:])),
        "mean_staleness": sum(stal) / max(1, len(stal)),
        "adapter_versions": int(state.latest_version) if state is not None else 0,
        "expired_leases": int(state.expired) if state is not None else 0,
        "revoked_leases": int(state.revoked) if state is not None else 0,
        "deadlettered": int(state.deadlettered) if state is not None else 0,
    }


def up(
    workers: int = typer.Option(2, "--workers", "-n", help="Rollout workers to start."),
    spec_path: str = typer.Option("", "--spec", help="Run spec file (YAML or TOML); default: the demo run."),
    demo: bool = typer.Option(False, "--demo", help="Run the demo (builds the demo model on first use)."),
    run: str = typer.Option("", "--run", help="Run id (default: from the spec)."),
    out: str = typer.Option("", "--out", help="Output folder (default ./brigade-runs/<run>)."),
    max_steps: int = typer.Option(0, "--max-steps", help="Override the spec's max_steps."),
    max_wall: float = typer.Option(900.0, "--max-wall", help="Stop after this many seconds whatever happens."),
    evaluator: bool = typer.Option(True, "--evaluator/--no-evaluator", help="Start the evaluator."),
    redis_url: options.RedisUrl = "",
    bucket: options.BucketUrl = "",
    port: int = typer.Option(0, "--port", help="Proxy port (default: a free one)."),
    token: options.Token = "",
) -> None:
    """Start every service on this machine and show the run's progress until it finishes."""
    from brigade.config import ConfigError
    from brigade.spec_file import build_spec
    from brigade_cli.devservers import free_port, start_redis

    overrides: dict = {} if spec_path else demo_overrides()
    if run:
        overrides["run_id"] = run
    elif not spec_path:
        # a fresh run id per demo: Redis (perhaps a shared one) and the bucket never mix two demos
        overrides["run_id"] = time.strftime("demo-%Y%m%d-%H%M%S")
    if max_steps:
        overrides["max_steps"] = max_steps
    try:
        spec = build_spec(overrides, path=spec_path or None)
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if spec.max_steps == 0:
        typer.echo("error: `brigade up` needs a finite max_steps (in the spec or --max-steps)", err=True)
        raise typer.Exit(2)
    out_dir = Path(out or f"brigade-runs/{spec.run_id}").resolve()
    logs = out_dir / "logs"
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_file = out_dir / "run.json"
    from brigade.spec_file import spec_to_dict

    spec_file.write_text(json.dumps(spec_to_dict(spec), indent=2))
    spec_yaml = out_dir / "run.yaml"
    import yaml

    spec_yaml.write_text(yaml.safe_dump(spec_to_dict(spec), sort_keys=False))

    redis_server = None
    if not redis_url or not redis_answers(redis_url):
        redis_server = start_redis(out_dir / "redis", appendonly=True)
        redis_url = redis_server.url
        typer.echo(f"started redis-server at {redis_url}")
    bucket = bucket or f"file://{out_dir / 'bucket'}"
    proxy = f"127.0.0.1:{port or free_port()}"
    env = dict(os.environ, BRIGADE_REDIS_URL=redis_url, BRIGADE_BUCKET=bucket, BRIGADE_PROXY=proxy,
               BRIGADE_LISTEN=proxy, BRIGADE_RUN=spec.run_id, BRIGADE_TOKEN=token, BRIGADE_LOG_FORMAT="json",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    fleet = Fleet(env)
    started = time.monotonic()
    state = None
    metrics: list[dict] = []
    failure: str | None = None
    try:
        if spec.model == "demo":  # build once, before N processes race to do it
            from brigade.model import resolve_model

            typer.echo(f"demo model: {resolve_model('demo')}")
        fleet.spawn("proxy", ["proxy"], logs)
        asyncio.run(wait_for_proxy(proxy, token))
        asyncio.run(create_run(proxy, token, spec))
        fleet.spawn("janitor", ["janitor"], logs)
        learner = fleet.spawn("learner", ["learner", "--spec", str(spec_yaml)], logs)
        for i in range(workers):
            fleet.spawn(f"rollout-{i}", ["rollout", "--worker-id", f"local-{i}", "--exit-when-finished"], logs)
        if evaluator:
            fleet.spawn("evaluator", ["evaluator"], logs)
        typer.echo(f"run {spec.run_id}: proxy {proxy}, bucket {bucket}, {workers} rollout workers; logs in {logs}")
        shown = 0
        while (learner.alive() or learner.crashed()) and time.monotonic() - started < max_wall:
            time.sleep(1.0)
            failure = fleet.restart_crashed(MAX_RESTARTS)
            if failure:
                typer.echo(f"error: {failure}", err=True)
                break
            try:
                metrics, state, live = asyncio.run(poll_metrics(proxy, token, spec.run_id))
            except Exception as e:  # progress is best effort; the run goes on
                typer.echo(f"(progress unavailable: {type(e).__name__})", err=True)
                continue
            elapsed = time.monotonic() - started
            samples = sum(m.get("accepted_samples", 0) for m in metrics)
            for m in metrics[shown:]:
                typer.echo(progress_line(m, live, samples / max(elapsed, 1e-9)))
            shown = len(metrics)
        if learner.alive() and not failure:
            typer.echo(f"stopping: --max-wall {max_wall:.0f}s reached", err=True)
        elif not failure:
            try:
                metrics, state, _ = asyncio.run(poll_metrics(proxy, token, spec.run_id))
            except Exception:
                pass
    except KeyboardInterrupt:
        typer.echo("interrupted: stopping every process", err=True)
    finally:
        wall = time.monotonic() - started
        fleet.stop_all()
        if redis_server is not None:
            redis_server.stop()
    summary = summarize(spec.run_id, metrics, state, wall)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    with (out_dir / "metrics.jsonl").open("w") as f:
        for m in metrics:
            f.write(json.dumps(m) + "\n")
    if metrics:
        from brigade_cli.plots import plot_run

        plot_run(metrics, out_dir)
    typer.echo(json.dumps(summary))
    typer.echo(f"summary, metrics and plots in {out_dir}")
    if failure:
        raise typer.Exit(1)
