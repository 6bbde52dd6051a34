"""`brigade evaluator`: on AdapterPublished (every `eval_every` versions) enqueue an rq job that
scores the adapter on held-out prompts; by default also runs the rq worker that executes them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

import typer
from prometheus_client import Counter

from brigade import keys
from brigade.settings import (
    BUCKET,
    LOG_LEVEL,
    METRICS_HOST,
    METRICS_PORT,
    METRICS_TOKEN,
    NO_RUN,
    REDIS_URL,
    RQ_REDIS_URL,
    RUN,
    RUN_REQUIRED,
    STATE_DIR,
    command,
    setting,
)

QUEUED = Counter("brigade_evaluator_evaluations_queued_total", "Evaluation jobs queued (one per evaluated version)")


async def watch(redis_url: str, bucket: str, run: str, log, rq_url: str = "") -> None:
    from rq import Queue as RqQueue

    from brigade.redis_clients import rq_client
    from brigade.store import Store

    rq_queue = RqQueue(keys.eval_queue(run), connection=rq_client(rq_url or redis_url))
    store = Store(redis_url, max_connections=4, blocking_connections=1)
    try:
        await store.runs.check_layout()
        while not await store.runs.exists(run):
            log.info("waiting for the run to be created", run=run)
            await asyncio.sleep(2)
        spec = (await store.runs.get(run)).spec
        # replay from the start: versions published while the evaluator was down get evaluated too;
        # the job id makes a second enqueue of one version a no-op
        async for event in store.views.events(run, from_start=True):
            if event.type != "AdapterPublished":
                continue
            version, step = int(event.attrs.get("version", "0")), int(event.attrs.get("step", "0"))
            if not keys.evaluates(version, step, spec.eval_every, spec.max_steps):
                continue
            job_id = keys.eval_job_id(run, version)
            if rq_queue.fetch_job(job_id) is None:
                rq_queue.enqueue("brigade_evaluator.evaluate.evaluate", run, version, bucket, redis_url, rq_url,
                                 job_id=job_id, job_timeout=600, result_ttl=86400, failure_ttl=86400)
                QUEUED.inc()
                log.info("evaluation queued", run=run, version=version)
    finally:
        await store.close()


async def probe_bucket(bucket_url: str, run: str) -> None:
    """The create-only check of the bucket the jobs write their results to (brigade.bucket.probe)."""
    from brigade.bucket import open_bucket, probe_at_start

    async with open_bucket(bucket_url) as bucket:
        await probe_at_start(bucket, run)


@dataclass(frozen=True)
class EvaluatorSettings:
    redis_url: str = REDIS_URL.field()
    rq_redis_url: str = RQ_REDIS_URL.field()
    bucket: str = BUCKET.field()
    run: str = RUN.field(**RUN_REQUIRED)
    worker: bool = setting(True, "Also run the rq worker that executes the jobs.",
                           flag="--worker/--no-worker")
    state_dir: str = STATE_DIR.field()
    metrics_port: int = METRICS_PORT.field()
    metrics_host: str = METRICS_HOST.field()
    metrics_token: str = METRICS_TOKEN.field()
    log_level: str = LOG_LEVEL.field()


@command(EvaluatorSettings)
def evaluator(s: EvaluatorSettings) -> None:
    """Evaluate published adapters on held-out prompts (rq jobs).

    Checks first that the bucket refuses a second create-only write (results are written once);
    exits 2 when it does not, or on a Redis it must not serve; 1 when it crashed, 3 when it crashed
    the same way 3 times in a row; 0 on SIGTERM or SIGINT.
    """
    from brigade.config import ConfigError
    from brigade.errors import LegacyKeys
    from brigade.log import configure_logging
    from brigade.proc import die_with_parent
    from brigade.service import crash_journal

    log = configure_logging("evaluator", s.log_level)
    from brigade.redis_clients import is_cluster

    if not s.run:
        typer.echo(f"brigade evaluator: {NO_RUN}", err=True)
        raise typer.Exit(2)
    rq_url = s.rq_redis_url or s.redis_url
    if is_cluster(rq_url):
        typer.echo(f"brigade evaluator: --redis-url {s.redis_url} is a Redis Cluster, which rq cannot use; give the "
                   "job queues a single-node Redis with --rq-redis-url (BRIGADE_RQ_REDIS_URL)", err=True)
        raise typer.Exit(2)
    journal = crash_journal("evaluator", s.run, s.state_dir)
    from brigade.prom import serve_metrics

    serve_metrics(s.metrics_port, s.metrics_host, s.metrics_token)
    # SIGTERM (docker stop, systemd, brigade up) unwinds like Ctrl-C, so the rq worker is stopped too
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def main() -> int:
        child = None
        try:
            # before anything is queued: a store that ignores If-None-Match would overwrite results
            asyncio.run(probe_bucket(s.bucket, s.run))
            if s.worker:
                # SimpleWorker: jobs run in the worker process, so the base model loads once, not per job
                child = subprocess.Popen([sys.executable, "-m", "brigade.rq_worker", "--url", rq_url, "--quiet",
                                          "--service", "evaluator", "--simple", keys.eval_queue(s.run)], env=os.environ,
                                         preexec_fn=die_with_parent)
            asyncio.run(watch(s.redis_url, s.bucket, s.run, log, rq_url))
        except KeyboardInterrupt:
            pass
        except ConfigError as e:  # CreateOnlyIgnored: one line naming the store
            log.error("config_error", error=str(e))
            return 2
        except LegacyKeys as e:
            typer.echo(f"brigade evaluator: {e}", err=True)
            return 2
        finally:
            if child is not None and child.poll() is None:
                # rq stops warm on the first SIGTERM (after the job in flight, which for a 135M model is
                # tens of seconds) and cold on the second: an evaluation still running after a second
                # is abandoned (its version goes unscored) rather than holding up the stop
                child.send_signal(signal.SIGTERM)
                try:
                    child.wait(1)
                except subprocess.TimeoutExpired:
                    child.send_signal(signal.SIGTERM)
                    try:
                        child.wait(5)
                    except subprocess.TimeoutExpired:
                        child.kill()
        return 0

    code = journal.run(main)
    if code:
        raise typer.Exit(code)


def main() -> None:
    """`brigade-evaluator` (and `python -m brigade_evaluator`): the same command as `brigade evaluator`."""
    typer.run(evaluator)
