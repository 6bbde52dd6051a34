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
import time
from pathlib import Path

import typer

from brigade import options

# restarts per service before `up` gives up: a process that keeps dying is broken, not unlucky
MAX_RESTARTS = 3


def demo_overrides() -> dict:
    """The demo run: the demo model and task, with the hyperparameters verified to climb."""
    from brigade.demo.task import DEMO_RUN

    return dict(DEMO_RUN)


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
    from brigade_cli.system import LocalSystem

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
    try:
        from brigade.task import check_task

        prompts = check_task(spec)  # a bad dataset, column or reward function: one line each, nothing started
    except ConfigError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    if spec.max_steps == 0:
        typer.echo("error: `brigade up` needs a finite max_steps (in the spec or --max-steps)", err=True)
        raise typer.Exit(2)
    out_dir = Path(out or f"brigade-runs/{spec.run_id}").resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_file = out_dir / "run.json"
    from brigade.spec_file import spec_to_dict

    spec_file.write_text(json.dumps(spec_to_dict(spec), indent=2))
    spec_yaml = out_dir / "run.yaml"
    import yaml

    spec_yaml.write_text(yaml.safe_dump(spec_to_dict(spec), sort_keys=False))

    system = LocalSystem(out_dir, redis_url=redis_url, appendonly=True, bucket=bucket, port=port, token=token,
                         run=spec.run_id)
    system.start_servers()
    if system.redis is not None:
        typer.echo(f"started redis-server at {system.redis_url}")
    proxy = system.proxy
    started = time.monotonic()
    state = None
    metrics: list[dict] = []
    failure: str | None = None
    try:
        if spec.model == "demo":  # build once, before N processes race to do it
            from brigade.model import resolve_model

            typer.echo(f"demo model: {resolve_model('demo')}")
        system.start_proxy()
        system.create_run(spec, prompts=prompts)
        system.spawn("janitor", ["janitor"])
        learner = system.spawn("learner", ["learner", "--spec", str(spec_yaml)])
        for i in range(workers):
            system.spawn(f"rollout-{i}", ["rollout", "--worker-id", f"local-{i}", "--exit-when-finished"])
        if evaluator:
            system.spawn("evaluator", ["evaluator"])
        typer.echo(f"run {spec.run_id}: proxy {proxy}, bucket {system.bucket}, {workers} rollout workers; "
                   f"logs in {system.logs}")
        shown = 0
        while (learner.alive() or learner.crashed()) and time.monotonic() - started < max_wall:
            time.sleep(1.0)
            failure = system.restart_crashed(MAX_RESTARTS)
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
        system.close()
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
