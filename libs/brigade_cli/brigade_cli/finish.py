"""How a `brigade up` run ends. When it fails: the cause, in one line (a reward function that
leaves every batch unscored, a stall). When it finishes: the evaluator finishes the evaluations
the run requested (so the last held-out point exists), one line names the final adapter and the
command that takes it out, and the adapter goes to the Hub when the spec asks."""

from __future__ import annotations

import re
import time
from pathlib import Path

import typer

# a rollout worker's warning (brigade.rewards) as last_problems() renders it
REWARD_REJECTED = re.compile(r"reward function result rejected.*?reward=(\S+).*?why=(.*?)(?: sandboxed=\w+)?$")
# how often the wait for the evaluator looks at its jobs
POLL_S = 0.5


def reward_failure(system) -> str | None:
    """A rollout worker's newest "reward function result rejected" warning, as `function: why`."""
    for name, svc in system.services.items():
        if name.startswith("rollout"):
            for problem in svc.last_problems(5):
                if m := REWARD_REJECTED.match(problem):
                    return f"{m[1]} {m[2]}"
    return None


def stall_cause(system, state) -> str:
    """Why batches fail: the newest warning of the learner and of each worker."""
    lines = []
    if state is not None:
        lines.append(f"{state.rejected} batches rejected by the learner, {state.deadlettered} dead-lettered")
    for name, svc in system.services.items():
        if name in ("learner", "aggregator") or name.startswith(("rollout", "trainer")):
            lines += [f"{name}: {problem}" for problem in svc.last_problems()]
    return "\n  ".join(lines)


def requested_evaluations(spec, latest: int, final_step: int) -> list[int]:
    """The versions the evaluator scores (brigade.keys.evaluates), up to `latest`, published at
    `final_step` (the others' steps do not matter: only the last is chosen by its step)."""
    from brigade import keys

    return [v for v in range(1, latest + 1)
            if keys.evaluates(v, final_step if v == latest else 0, spec.eval_every, spec.max_steps)]


def finish_evaluations(rq_url: str, run: str, versions: list[int], timeout: float) -> tuple[list[int], float]:
    """Wait, at most `timeout` seconds, until the evaluation job of every version in `versions` has
    ended (scored, or failed: a failure is the evaluator's to report, not a reason to wait on).
    Returns the versions still unscored and the seconds waited."""
    from rq.exceptions import NoSuchJobError
    from rq.job import Job, JobStatus

    from brigade import keys
    from brigade.redis_clients import rq_client

    ended = {JobStatus.FINISHED, JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED}
    started, pending = time.monotonic(), list(versions)
    conn = rq_client(rq_url)
    try:
        while pending and time.monotonic() - started < timeout:
            still = []
            for v in pending:
                try:
                    status = Job.fetch(keys.eval_job_id(run, v), connection=conn).get_status()
                except NoSuchJobError:  # the watcher has not queued it yet
                    status = None
                if status not in ended:
                    still.append(v)
            pending = still
            if pending:
                time.sleep(POLL_S)
    finally:
        conn.close()
    return pending, time.monotonic() - started


def wait_for_evaluator(system, spec, state, timeout: float) -> float:
    """`up`'s step between stopping training and stopping the evaluator, with a line before and after;
    the seconds it waited."""
    if state is None or "evaluator" not in system.services or not system.services["evaluator"].alive():
        return 0.0
    versions = requested_evaluations(spec, int(state.latest_version), int(state.learner_step))
    if not versions or timeout <= 0:
        return 0.0
    try:
        import rq  # noqa: F401 - the evaluator's own dependency: without it there is no evaluator to wait for
    except ImportError:
        return 0.0
    typer.echo(f"evaluator: finishing the evaluations of the run (v{versions[-1]} last), at most {timeout:.0f} s")
    pending, waited = finish_evaluations(system.rq_url or system.redis_url, spec.run_id, versions, timeout)
    if pending:
        typer.echo(f"evaluator: {', '.join(f'v{v}' for v in pending)} not scored after {waited:.0f} s "
                   "(--eval-timeout); stopping it", err=True)
    else:
        typer.echo(f"evaluator: done in {waited:.1f} s")
    return waited


def final_adapter_line(spec, state, evals, bucket: str) -> str:
    """One line naming the final adapter, its held-out score, and the export command. `evals`:
    (learner step, evaluation) pairs, as `up` polls them; the evaluation names its version."""
    from brigade import keys
    from brigade_cli.export import export_command
    from brigade_cli.plots import best_version, heldout_score

    version = int(state.latest_version) if state is not None else 0
    if version == 0:
        return "no adapter was published"
    scores = {int(e["version"]): s for _, e in evals
              if isinstance(e.get("version"), int) and (s := heldout_score(e)) is not None}
    held = f", held-out {scores[version]:.3f}" if version in scores else ""
    best = best_version(scores)
    hint = f" (--best: v{best[0]}, {best[1]:.3f})" if best and best[0] != version else ""
    where = bucket.rstrip("/") + "/" + keys.adapter_prefix(spec.run_id, version)
    return (f"final adapter: v{version}{held} at {where}; take it out with: "
            f"{export_command(spec.run_id, bucket)}{hint}")


def push_final(spec, bucket: str, out_dir: Path) -> bool:
    """push_to_hub in the spec: export the final adapter to `out_dir`/export and upload it. False
    when it failed (said in one line; the export folder, if written, stays)."""
    from brigade.config import ConfigError
    from brigade_cli.export import export_run

    repo = spec.hub_model_id or spec.run_id
    try:
        done = export_run(spec.run_id, out_dir / "export", bucket=bucket, push_to_hub=repo, log=typer.echo)
    except ConfigError as e:
        typer.echo(f"error: push_to_hub: {e}", err=True)
        return False
    typer.echo(f"pushed v{done.version} to {done.hub_url}")
    return True
