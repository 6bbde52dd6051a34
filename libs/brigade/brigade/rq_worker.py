"""`python -m brigade.rq_worker`: an rq worker whose log lines are brigade's (JSON in JSON mode), for
the evaluator's jobs and the sandboxed reward functions. `rq worker` itself would print its own
plain-text lines into a service log that is otherwise all JSON."""

from __future__ import annotations

import argparse
import os

from brigade.log import configure_logging


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m brigade.rq_worker")
    p.add_argument("--url", required=True, help="Redis URL")
    p.add_argument("--service", default="rq-worker", help="the `service` field of its log lines")
    p.add_argument("--name", default="", help="worker name (default: rq's)")
    p.add_argument("--simple", action="store_true", help="run jobs in this process (rq's SimpleWorker)")
    p.add_argument("--quiet", action="store_true", help="warnings and errors only")
    p.add_argument("queues", nargs="+")
    args = p.parse_args(argv)
    configure_logging(args.service, os.environ.get("BRIGADE_LOG_LEVEL", "info"))
    from redis import Redis
    from rq import Queue
    from rq.worker import SimpleWorker, Worker

    conn = Redis.from_url(args.url)
    cls = SimpleWorker if args.simple else Worker
    worker = cls([Queue(q, connection=conn) for q in args.queues], connection=conn, name=args.name or None)
    worker.work(logging_level="WARNING" if args.quiet else "INFO")


if __name__ == "__main__":
    main()
