"""`brigade up`: the whole system on one machine, each service its own process.

Redis (the one at BRIGADE_REDIS_URL if it answers, else a redis-server of our own), the bucket (a
local folder unless BRIGADE_BUCKET says otherwise), proxy, janitor, learner, N rollout workers and
the evaluator. Checks the spec, its model, datasets and reward functions before starting anything;
shows progress; restarts a service that dies (MAX_RESTARTS times each; each one resumes from Redis
and the bucket), but not one that exits 2 (a bad configuration) or 3 (a crash loop): the run stops
with that service's last line; stops the run when it makes no progress while batches keep failing,
with the cause; stops everything it started on exit, Ctrl-C or SIGTERM; and leaves summary.json,
metrics.jsonl, plots, logs and a snapshot that `brigade ctl` reads in the run's output folder.

Exit status: 0 the run reached max_steps; 1 a service kept dying or would not start again, the
run stalled, or the spec's push_to_hub failed; 2 a bad spec, file or run id (nothing was
started); 3 --max-wall was reached; 128+N stopped by signal N (130 for Ctrl-C, 143 for SIGTERM).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import signal
import time
from pathlib import Path

import typer

from brigade import settings
from brigade_cli.finish import reward_failure, stall_cause
from brigade_cli.live import Progress
from brigade_cli.plots import heldout_score

# restarts per service before `up` gives up: a process that keeps dying is broken, not unlucky
MAX_RESTARTS = 3
# a stall is this many failed batches and no step: one stale rejection before a slow step is not
STALL_MIN_FAILURES = 3
# a new run whose first this-many batches a reward function left unscored stops at once, with that
# function's error: it would fail every batch, and the stall timeout is a minute of nothing
FAIL_FAST_BATCHES = 2
EXIT_FINISHED, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_MAX_WALL = 0, 1, 2, 3


class Stopped(BaseException):
    """A signal asked `up` to stop; it stops every service in order, as for Ctrl-C. A BaseException,
    as KeyboardInterrupt is: the best-effort `except Exception` around the progress poll must not
    swallow a SIGTERM that lands while the poll runs (the run then trained on to its end, exit 0)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame) -> None:
    raise Stopped(signum)


def demo_overrides() -> dict:
    """The demo run: the demo model and task, with the hyperparameters verified to climb."""
    from brigade.demo.task import DEMO_RUN

    return dict(DEMO_RUN)


def default_run_id(spec_path: str) -> str:
    """A spec without run_id gets one of its own per launch (file name and time), so two specs, or
    two launches of one, never share a run by accident; `--run` or `run_id` names one on purpose."""
    stem = re.sub(r"[^a-z0-9._-]+", "-", Path(spec_path).stem.lower()).strip("-._") or "run"
    return f"{stem[:40]}-{time.strftime('%Y%m%d-%H%M%S')}"


async def poll_run(proxy: str, token: str, run: str) -> tuple[list[dict], object, int, list[tuple[int, dict]]]:
    """Metrics of every step, the run's counters, live workers, and held-out scores by step."""
    from brigade.rpc import ProxyClient
    from brigade.v1 import brigade_pb2 as pb

    async with ProxyClient.connect(proxy, token) as client:
        metrics = await client.runs.GetMetrics(pb.GetMetricsRequest(run_id=run), timeout=5)
        state = await client.runs.GetRun(pb.RunRef(run_id=run), timeout=5)
        workers = await client.runs.ListWorkers(pb.RunRef(run_id=run), timeout=5)
        adapters = await client.runs.ListAdapters(pb.RunRef(run_id=run), timeout=5)
    now_ms = time.time() * 1000
    live = sum(1 for w in workers.workers if now_ms - w.last_seen_ms < 30_000)
    steps = [m for s in metrics.steps if (m := numeric_metrics(s.metrics_json))]
    evals = [(a.step, e) for a in adapters.adapters if isinstance(e := _json(a.eval_json), dict)]
    return steps, state, live, evals


def numeric_metrics(text: str) -> dict:
    """A step's metrics as the learner writes them (a JSON object), numbers only: anyone holding the
    token can write a step's metrics_json, and progress must not stop on a string or a list."""
    m = _json(text)
    if not isinstance(m, dict):
        return {}
    return {k: v for k, v in m.items() if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


def _json(text: str):
    try:
        return json.loads(text) if text else None
    except (ValueError, RecursionError):
        return None


def recent_rate(metrics: list[dict], window_s: float = 30.0) -> float:
    """Accepted samples per second over the steps of the last `window_s` (not since launch)."""
    timed = [m for m in metrics if isinstance(m.get("time_unix"), int | float)]
    if len(timed) < 2:
        return 0.0
    end = timed[-1]["time_unix"]
    inside = [m for m in timed if m["time_unix"] >= end - window_s]
    if len(inside) < 2:
        inside = timed[-2:]
    span = inside[-1]["time_unix"] - inside[0]["time_unix"]
    return sum(m.get("accepted_samples", 0) for m in inside[1:]) / span if span > 0 else 0.0


def progress_line(m: dict, max_steps: int, live_workers: int, samples_per_s: float, heldout: float | None,
                  eta: str = "") -> str:
    held = f"  held-out {heldout:.3f}" if heldout is not None else ""
    eta = f"  ETA {eta}" if eta else ""
    return (f"step {m.get('step', 0):>4}/{max_steps}{eta}  reward {m.get('reward_mean', float('nan')):.3f}{held}  "
            f"kl {m.get('kl', 0.0):.4f}  staleness {m.get('staleness_mean', 0.0):.2f}  "
            f"rejected {m.get('rejection_rate', 0.0):.1%}  workers {live_workers}  {samples_per_s:.1f} samples/s")


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 4) if values else None


def summarize(run: str, metrics: list[dict], state, wall_s: float, outcome: str,
              evals: list[tuple[int, dict]]) -> dict:
    rewards = [m["reward_mean"] for m in metrics if isinstance(m.get("reward_mean"), int | float)]
    stal = [m.get("staleness_mean", 0.0) for m in metrics]
    scores = [s for s in (heldout_score(e) for _, e in evals) if s is not None]
    return {
        "run": run,
        "outcome": outcome,
        "steps": int(state.learner_step) if state is not None else len(metrics),
        "wall_s": round(wall_s, 1),
        "samples": int(sum(m.get("accepted_samples", 0) for m in metrics)),
        "rejected": int(state.rejected + state.stale_removed) if state is not None else 0,
        # None, not 0.0, when no step was trained: a failed run has no reward
        "first20_reward": _mean(rewards[:20]),
        "last20_reward": _mean(rewards[-20:]),
        "heldout_first": scores[0] if scores else None,
        "heldout_last": scores[-1] if scores else None,
        "mean_staleness": _mean(stal),
        "adapter_versions": int(state.latest_version) if state is not None else 0,
        "expired_leases": int(state.expired) if state is not None else 0,
        "revoked_leases": int(state.revoked) if state is not None else 0,
        "deadlettered": int(state.deadlettered) if state is not None else 0,
    }


def _refuse(message: str) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def up(
    workers: int = typer.Option(2, "--workers", "-n",
                                help="Rollout workers to start (local trainers with topology local_sgd)."),
    spec_path: str = typer.Option("", "--spec", help="Run spec file (YAML or TOML); default: the demo run."),
    demo: bool = typer.Option(False, "--demo", help="Run the demo (builds the demo model on first use)."),
    run: str = typer.Option("", "--run", help="Run id (default: the spec's run_id, else one per launch)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the existing run with this id (same spec)."),
    out: str = typer.Option("", "--out", help="Output folder (default ./brigade-runs/<run>)."),
    max_steps: int = typer.Option(0, "--max-steps", help="Override the spec's max_steps (rounds with local_sgd)."),
    topology: str = typer.Option("", "--topology", help="Override the spec's topology: central or local_sgd."),
    max_wall: float = typer.Option(900.0, "--max-wall", help="Stop after this many seconds whatever happens."),
    stall_s: float = typer.Option(60.0, "--stall-timeout",
                                  help="Stop when no step was trained for this long while batches keep failing."),
    evaluator: bool = typer.Option(True, "--evaluator/--no-evaluator", help="Start the evaluator."),
    eval_timeout: float = typer.Option(300.0, "--eval-timeout",
                                       help="When the run finishes, wait this long for the evaluations it requested "
                                            "(the last version's included) before stopping the evaluator."),
    redis_url: settings.RedisUrl = "",
    bucket: settings.BucketUrl = "",
    port: int = typer.Option(0, "--port", help="Proxy port (default: a free one)."),
    token: settings.Token = "",
    fork: bool = typer.Option(True, "--fork/--no-fork",
                              help="Fork the learner, workers and evaluator from one process that imported torch "
                                   "once (fast start); --no-fork starts each as a fresh python."),
    threads: str = typer.Option("", "--threads", metavar="LEARNER,WORKER",
                                help="torch threads of the learner and of each worker (default: every core to "
                                     "each side with sync, one each async)."),
) -> None:
    """Start every service on this machine and show the run's progress until it finishes."""
    launched = time.time()
    thread_counts = threads_override(threads)
    forker = None
    if fork:  # first of all: it imports torch and the services while the spec is checked
        import atexit
        import os

        from brigade_cli.forkserver import ForkServer
        from brigade_harness.system import process_env

        forker = ForkServer(process_env(dict(os.environ)))
        atexit.register(forker.close)  # the refusals below exit without reaching the finally
    from brigade.config import ConfigError
    from brigade.spec_file import build_spec, read_spec_file
    from brigade_cli.preflight import preflight, unknown_characters

    overrides: dict = {} if spec_path else demo_overrides()
    if run:
        overrides["run_id"] = run
    elif not spec_path:
        # a fresh run id per demo: Redis (perhaps a shared one) and the bucket never mix two demos
        overrides["run_id"] = time.strftime("demo-%Y%m%d-%H%M%S")
    if max_steps:
        overrides["max_steps"] = max_steps
    if topology:
        overrides["topology"] = topology
    if not spec_path and topology == "local_sgd":
        from brigade.demo.task import DEMO_LOCAL_SGD
        from brigade.spec_file import merge_spec_data

        overrides = merge_spec_data(overrides, DEMO_LOCAL_SGD)
    try:
        if spec_path and not run and "run_id" not in read_spec_file(spec_path):
            if resume:
                _refuse("--resume needs the run's id: --run RUN (or run_id in the spec)")
            overrides["run_id"] = default_run_id(spec_path)
        spec = build_spec(overrides, path=spec_path or None)
        # the spec file is the user's own, run on their own machine: what it names is allowed to
        # the checks here and to the services started below (brigade.code_policy.local_allowance)
        import os

        from brigade.code_policy import local_allowance

        os.environ.update(local_allowance(spec))
        prompts = preflight(spec)  # a bad model, dataset, column or reward: one line each, nothing started
    except ConfigError as e:
        _refuse(str(e))
    if warning := unknown_characters(spec, prompts):
        typer.echo(warning, err=True)
    if spec.max_steps == 0:
        _refuse("`brigade up` needs a finite max_steps (in the spec or --max-steps)")
    out_dir = Path(out or f"brigade-runs/{spec.run_id}").resolve()
    if (out_dir / "run.yaml").exists() and not resume:
        _refuse(f"run {spec.run_id} already ran in {out_dir}; --resume continues it, --run NEW starts another")

    # SIGTERM (a supervisor, CI, `timeout`) stops the run as Ctrl-C does: in order, with a summary
    signal.signal(signal.SIGTERM, _raise_stopped)
    from brigade_cli.local_runs import write_endpoint
    from brigade_harness.system import LocalSystem

    out_dir.mkdir(parents=True, exist_ok=True)
    system = LocalSystem(out_dir, redis_url=redis_url, appendonly=True, bucket=bucket, port=port, token=token,
                         run=spec.run_id, forker=forker)
    proxy = system.proxy
    started, started_unix = time.monotonic(), time.time()
    state, metrics, evals = None, [], []
    outcome, code, failure, created = "finished", EXIT_FINISHED, None, False
    progress = None
    try:
        system.start_servers()
        if system.redis is not None:
            typer.echo(f"started redis-server at {system.redis_url}")
        if system.rq_redis is not None:
            typer.echo(f"started redis-server for rq's queues at {system.rq_url} (rq cannot use Redis Cluster)")
        if spec.model == "demo" and forker is None:  # build once, before N processes race to do it
            from brigade.model import resolve_model

            typer.echo(f"demo model: {resolve_model('demo')}")
        elif spec.model == "demo":  # keep torch out of `up`: the first forked service builds it, under a lock
            from brigade.demo.task import default_model_dir

            if not default_model_dir().exists():
                typer.echo(f"demo model: built on first use in {default_model_dir()} (once, about a minute)")
        system.start_proxy()
        _create(system, spec, resume, prompts)
        created = True
        write_endpoint(out_dir, spec.run_id, proxy)
        write_spec(out_dir, spec)
        system.spawn("janitor", ["janitor"])
        driver, fleet = spawn_training(system, spec, workers, out_dir / "run.yaml", thread_counts)
        if evaluator:
            system.spawn("evaluator", ["evaluator"])
        typer.echo(f"run {spec.run_id}: proxy {proxy}, bucket {system.bucket}, {workers} {fleet}; "
                   f"logs in {system.logs}; `brigade ctl status` shows it")
        # a resumed run: show only the steps trained from now on
        shown, failed_at_step, failing_since = -1 if resume else 0, 0, None
        progress = Progress(spec.max_steps, progress_line, recent_rate)
        while driver.alive() or driver.crashed():
            if time.monotonic() - started >= max_wall:
                outcome, code = "max_wall", EXIT_MAX_WALL
                typer.echo(f"stopping: --max-wall {max_wall:.0f}s reached", err=True)
                break
            time.sleep(1.0)
            failure = system.restart_crashed(MAX_RESTARTS)
            if failure:
                break
            try:
                metrics, state, live, evals = asyncio.run(poll_run(proxy, token, spec.run_id))
            except Exception as e:  # progress is best effort; the run goes on
                typer.echo(f"(progress unavailable: {type(e).__name__})", err=True)
                continue
            if shown < 0:
                shown, failed_at_step = len(metrics), state.rejected + state.deadlettered
            heldout = next((heldout_score(e) for _, e in reversed(evals)), None)
            progress.show(metrics, shown, live, heldout)
            failed = state.rejected + state.deadlettered
            if not resume and not metrics and failed >= FAIL_FAST_BATCHES and (cause := reward_failure(system)):
                failure = f"the first {failed} batches were left unscored by a reward function: {cause}"
                break
            if len(metrics) > shown:
                shown, failed_at_step, failing_since = len(metrics), failed, None
            elif failed > failed_at_step and failing_since is None:
                failing_since = time.monotonic()
            if (failing_since is not None and failed - failed_at_step >= STALL_MIN_FAILURES
                    and time.monotonic() - failing_since > stall_s):
                failure = (f"no step trained in the {stall_s:.0f}s since batches began to fail:\n  "
                           f"{stall_cause(system, state)}")
                break
        if failure:
            # every service that died, newest problems first in its log: the cause, not a symptom
            failure += "".join(f"\n  {name}: {p}" for name, svc in system.services.items()
                               if svc.starts > 1 or svc.crashed() for p in svc.last_problems())
            outcome, code = "failed", EXIT_FAILED
            typer.echo(f"error: {failure}", err=True)
    except KeyboardInterrupt:
        outcome, code = "interrupted", 128 + signal.SIGINT
        typer.echo("interrupted: stopping every process", err=True)
    except Stopped as e:
        outcome, code = "terminated", 128 + e.signum
        typer.echo(f"{e}: stopping every process", err=True)
    except _Refused as e:
        outcome, code = "refused", EXIT_BAD_INPUT
        typer.echo(f"error: {e}", err=True)
    finally:
        if progress is not None:
            progress.close()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the ordered stop short
        stopping, eval_wait = time.monotonic(), 0.0
        if created:  # training stopped first, so the last read and the snapshot agree with each other
            system.stop_services(keep=("proxy", "janitor", "evaluator"))
            if outcome == "finished":  # the last held-out point: the evaluations the run requested
                from brigade_cli.finish import wait_for_evaluator

                eval_wait = wait_for_evaluator(system, spec, _state_now(system, spec.run_id, state),
                                               eval_timeout)
            system.stop_services(keep=("proxy", "janitor"))
            metrics, state, evals = _final_read(system, token, spec.run_id, out_dir, metrics, state, evals)
        wall = time.monotonic() - started
        system.close()
        if forker is not None:
            forker.close()
        first = metrics[0].get("time_unix") if metrics and not resume else None
        timing = {"startup_s": round(first - launched, 2) if isinstance(first, int | float) else None,
                  "shutdown_s": round(time.monotonic() - stopping - eval_wait, 2), "eval_wait_s": round(eval_wait, 2)}
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if created:  # a refused run leaves the folder of the run it collided with as it was
        from brigade_cli.finish import final_adapter_line, push_final

        _write_results(out_dir, spec, metrics, state, evals, wall, outcome, started_unix, timing)
        typer.echo(final_adapter_line(spec, state, evals, system.bucket))
        if outcome == "finished" and spec.push_to_hub and not push_final(spec, system.bucket, out_dir):
            code = EXIT_FAILED
    raise typer.Exit(code)


def spawn_training(system, spec, n: int, spec_file: Path, threads: tuple[int, int] | None = None):
    """The processes that train, by topology: the learner and n rollout workers (central), or the
    aggregator and n local trainers (local_sgd). Returns the one whose exit ends the run, and what
    the n are called."""
    if spec.topology == "local_sgd":
        driver = system.spawn("aggregator", ["aggregator"])
        for i in range(n):
            system.spawn(f"trainer-{i}", ["trainer", "--trainer-id", f"local-{i}", "--exit-when-finished"])
        return driver, "local trainers"
    learner_threads, worker_threads = threads or torch_threads(spec, n, _cores())
    driver = system.spawn("learner", ["learner", "--spec", str(spec_file), "--torch-threads", str(learner_threads)])
    for i in range(n):
        system.spawn(f"rollout-{i}", ["rollout", "--worker-id", f"local-{i}", "--exit-when-finished",
                                      "--torch-threads", str(worker_threads)])
    return driver, "rollout workers"


def torch_threads(spec, workers: int, cores: int) -> tuple[int, int]:
    """torch threads of the learner and of each rollout worker: the cores go to whoever computes at
    the time. With sync the two sides take turns (the workers generate, then the learner trains),
    so each side gets every core (the workers share them). Async, each worker keeps one thread and
    the learner takes the cores the workers leave and one more: with automatic lookahead a worker
    that generates faster than the learner trains waits for each version, and its core is the
    learner's while it waits (measured on the recipe: 33 s a step against 37 s with one thread
    each; bench/report.md, "Staleness")."""
    if spec.sync:
        return cores, max(1, cores // workers)
    return max(1, cores - workers + 1), 1


def threads_override(text: str) -> tuple[int, int] | None:
    """--threads LEARNER,WORKER: two counts of at least 1, or "" for the launcher's choice."""
    if not text:
        return None
    try:
        learner, worker = (int(x) for x in text.split(","))
    except ValueError:
        raise typer.BadParameter(f"--threads takes LEARNER,WORKER (two whole numbers), got {text!r}") from None
    if min(learner, worker) < 1:
        raise typer.BadParameter(f"--threads: each count must be at least 1, got {text!r}")
    return learner, worker


def _cores() -> int:
    import os

    return len(os.sched_getaffinity(0))


class _Refused(Exception):
    """The proxy refused the run (a reused id, a spec it rejects): one line, nothing trained."""


def _create(system, spec, resume: bool, prompts) -> None:
    import grpc

    from brigade.rpc import describe_rpc_error

    try:
        existing = system.get_run(spec.run_id)
        if existing is not None and not resume:
            raise _Refused(f"run {spec.run_id} already exists in Redis at {system.redis_url} (step "
                           f"{existing.learner_step}); --resume continues it, --run NEW starts another")
        # exist_ok: the check above decided; a retried CreateRun must not trip on its own first try
        system.create_run(spec, prompts=prompts)
    except grpc.aio.AioRpcError as e:
        if e.code() == grpc.StatusCode.ALREADY_EXISTS:
            raise _Refused(f"run {spec.run_id} exists with a different spec ({e.details()}); resume it with its "
                           f"own spec, or start another with --run NEW") from None
        raise _Refused(describe_rpc_error(e, system.proxy)) from None


def write_spec(out_dir: Path, spec) -> None:
    """run.yaml (what the learner reads) and run.json, once the proxy accepted the spec."""
    import yaml

    from brigade.spec_file import spec_to_dict

    (out_dir / "run.json").write_text(json.dumps(spec_to_dict(spec), indent=2))
    (out_dir / "run.yaml").write_text(yaml.safe_dump(spec_to_dict(spec), sort_keys=False))


def _state_now(system, run: str, state):
    """The run's state as the proxy has it now (the last poll may predate the final step)."""
    try:
        return system.get_run(run) or state
    except Exception:  # noqa: BLE001 - best effort: the proxy may be what failed
        return state


def _final_read(system, token: str, run: str, out_dir: Path, metrics, state, evals):
    """The last metrics, and the snapshot `brigade ctl` reads once the proxy is gone; best effort
    (the proxy may be the thing that failed)."""
    from brigade.rpc import ProxyClient
    from brigade_cli.local_runs import write_snapshot

    proxy = system.services.get("proxy")
    if proxy is None or not proxy.alive():
        return metrics, state, evals

    async def read():
        out = await poll_run(system.proxy, token, run)
        async with ProxyClient.connect(system.proxy, token) as client:
            await write_snapshot(out_dir, client, run)
        return out

    try:
        metrics, state, _, evals = asyncio.run(read())
    except Exception as e:  # noqa: BLE001 - what was read before stands
        typer.echo(f"(final read failed: {type(e).__name__}: {e})", err=True)
    return metrics, state, evals


def _write_results(out_dir: Path, spec, metrics, state, evals, wall: float, outcome: str, started_unix: float,
                   timing: dict) -> None:
    # startup_s: from the launch of `up` to the first trained step; shutdown_s: the ordered stop, less
    # eval_wait_s, the wait for the evaluator's last evaluations
    summary = summarize(spec.run_id, metrics, state, wall, outcome, evals) | timing
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    from brigade.metric_names import trl_metrics

    with (out_dir / "metrics.jsonl").open("w") as f:  # TRL's names, as the trackers have them
        for m in metrics:
            f.write(json.dumps(trl_metrics(m)) + "\n")
    if metrics:
        from brigade_cli.plots import plot_run

        plot_run(metrics, out_dir, title=f"run {spec.run_id}", evals=evals, t0=started_unix)
    typer.echo(json.dumps(summary))
    typer.echo(f"summary, metrics and plots in {out_dir}")
