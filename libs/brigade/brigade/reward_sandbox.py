"""Where reward code runs, so that nothing it does can take a rollout worker (or the evaluator, or a
local_sgd trainer) down: see brigade.rewards for the contract.

- in-process functions run in a daemon thread of their own (`in_daemon_thread`), async ones on an
  event loop of their own (`on_async_loop`): the caller's loop keeps heartbeating, and a hung
  function is abandoned at its timeout without holding up the process's exit;
- sandboxed functions run as rq jobs (`RqSandbox`) in an rq worker process on the run's queue
  (`brigade.keys.reward_queue`); a job not picked up within its timeout + QUEUE_GRACE_S is given up.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
from collections.abc import Callable

import structlog

from brigade.proc import die_with_parent
from brigade.reward_call import RewardCall

log = structlog.get_logger()

QUEUE_GRACE_S = 10.0  # how long a sandboxed job may wait in the queue before its own timeout starts


async def as_coroutine(awaitable):
    """Any awaitable as the coroutine that asyncio.run and run_coroutine_threadsafe take."""
    return await awaitable


def on_async_loop(awaitable, timeout_s: float):
    """Await `awaitable` on the reward loop (`_async_loop`), from the caller's loop, up to `timeout_s`."""
    future = asyncio.run_coroutine_threadsafe(as_coroutine(awaitable), _async_loop())
    return asyncio.wait_for(asyncio.wrap_future(future), timeout_s)


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _async_loop() -> asyncio.AbstractEventLoop:
    """The event loop async reward functions run on, in a daemon thread of its own (as TRL keeps
    one): one that blocks its loop cannot stall the worker's heartbeats."""
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="reward-async", daemon=True).start()
        return _loop


def in_daemon_thread(fn: Callable, **kwargs) -> asyncio.Future:
    """Run fn in its own daemon thread: the event loop (heartbeats) keeps going, and a hung function
    is abandoned after its timeout without holding up the process's exit, which the default
    executor's threads would (asyncio.run joins them)."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def settle(result, error) -> None:
        if not fut.done():
            fut.set_exception(error) if error is not None else fut.set_result(result)

    def target() -> None:
        try:
            result, error = fn(**kwargs), None
        except BaseException as e:  # handed to the awaiting task, which contains it
            result, error = None, e
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:  # the loop is gone: nobody is waiting any more
            pass

    threading.Thread(target=target, name=f"reward-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return fut


class RqSandbox:
    """Runs reward calls as rq jobs on `queue`; optionally owns an rq worker subprocess for it."""

    def __init__(self, redis_url: str, queue: str, start_worker: bool = True, poll_s: float = 0.05):
        from rq import Queue

        from brigade.redis_clients import rq_client

        self.redis_url, self.queue_name, self.poll_s = redis_url, queue, poll_s
        self.redis = rq_client(redis_url)  # ValueError for a cluster: rq needs a single node
        self.queue = Queue(queue, connection=self.redis)
        self.worker: subprocess.Popen | None = None
        if start_worker:
            self.start_worker()

    def start_worker(self) -> None:
        # the rq worker dies with us (PDEATHSIG), so a SIGKILLed rollout worker leaves no orphan
        self.worker = subprocess.Popen(
            [sys.executable, "-m", "brigade.rq_worker", "--url", self.redis_url, "--quiet", "--service", "rewards",
             "--name", f"{self.queue_name}:{os.uname().nodename}:{os.getpid()}", self.queue_name],
            stdin=subprocess.DEVNULL, preexec_fn=die_with_parent,
        )

    async def call(self, function: str, call: RewardCall, kwargs_json: str, timeout_s: float) -> dict:
        from rq.job import JobStatus

        if self.worker is not None and self.worker.poll() is not None:
            log.warning("rq reward worker exited; restarting it", code=self.worker.returncode)
            self.start_worker()
        job = await asyncio.to_thread(
            self.queue.enqueue, "brigade.rewards.run_reward_job",
            kwargs=dict(function=function, call=call, kwargs_json=kwargs_json),
            job_timeout=max(1, math.ceil(timeout_s)), result_ttl=300, failure_ttl=3600,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s + QUEUE_GRACE_S
        try:
            while loop.time() < deadline:
                status = await asyncio.to_thread(job.get_status)
                if status == JobStatus.FINISHED:
                    return await asyncio.to_thread(job.return_value)
                if status in (JobStatus.FAILED, JobStatus.STOPPED, JobStatus.CANCELED):
                    result = await asyncio.to_thread(job.latest_result)
                    reason = (getattr(result, "exc_string", "") or str(status)).strip().splitlines()[-1:]
                    raise RuntimeError(f"rq job {job.id} {status}: {' '.join(reason)}")
                await asyncio.sleep(self.poll_s)
            raise TimeoutError()
        finally:
            if job.get_status(refresh=False) not in (JobStatus.FINISHED, JobStatus.FAILED):
                await asyncio.to_thread(_cancel, job, self.redis)

    def close(self) -> None:
        if self.worker is not None and self.worker.poll() is None:
            self.worker.terminate()
            try:
                self.worker.wait(3)
            except subprocess.TimeoutExpired:
                self.worker.kill()
                self.worker.wait()
        self.redis.close()


def _cancel(job, redis) -> None:
    """Best effort: drop a queued job, stop a running one (the worker kills its work horse)."""
    from rq.command import send_stop_job_command

    for action in (job.cancel, lambda: send_stop_job_command(redis, job.id)):
        try:
            action()
        except Exception:  # already finished, gone, or not running: nothing to stop
            pass
