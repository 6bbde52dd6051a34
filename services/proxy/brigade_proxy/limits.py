"""The proxy's limits: each one declared once here, with its default, its bounds and what it bounds.

`brigade proxy` has a flag and a BRIGADE_* variable for each (`brigade.settings.command` builds them
from these fields); docs/configuration.md lists them. What is refused beyond a limit:

- a request over its method's size: RESOURCE_EXHAUSTED, before it is parsed (CreateRun may be up to
  max_message_bytes, which is also gRPC's receive limit, the most any one call can buffer; every
  other method up to max_request_bytes);
- a CreateRun beyond max_create_runs at once, a WatchRun beyond max_streams (in total) or
  max_streams_per_client (per client address), a PullRollouts beyond max_pulls or
  max_pulls_per_client: RESOURCE_EXHAUSTED, transient (`brigade.rpc.is_transient`), before the
  request is read;
- any call beyond max_rpcs in flight: gRPC's own RESOURCE_EXHAUSTED, before the request is read.

With a tokens file (credentials.py) each credential also has quotas of its own, so that one client
cannot use up a cap shared by everyone: CreateRun calls in flight (max_create_runs_per_credential,
what bounds the request bytes one credential makes the proxy buffer), runs created
(max_runs_per_credential, under the store's MAX_RUNS) and worker ids per run
(max_worker_ids_per_credential, under the run-wide backstop brigade.spec.MAX_WORKER_IDS_PER_RUN).
Beyond them: RESOURCE_EXHAUSTED (the in-flight one transient). In one-token mode and without auth
there is one credential, and the caps are the shared ones above and brigade.spec.MAX_WORKERS_PER_RUN.
"""

from __future__ import annotations

from dataclasses import dataclass

from brigade.settings import setting, validate
from brigade.spec import MAX_PROMPTS, MAX_WORKER_IDS_PER_RUN, MAX_WORKERS_PER_RUN
from brigade.wire import MAX_RUNS

MIB = 1024 * 1024


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = setting(32 * MIB,
                                     "Bytes of a CreateRun request (its prompt set); gRPC's receive limit.",
                                     env="BRIGADE_MAX_MESSAGE_BYTES", low=1 * MIB, high=1024 * MIB)
    max_request_bytes: int = setting(4 * MIB, "Bytes of a request of any other method.",
                                     env="BRIGADE_MAX_REQUEST_BYTES", low=64 * 1024, high=1024 * MIB)
    # at most the store's own ceiling (brigade.spec.MAX_PROMPTS): an operator may only lower it
    max_prompts: int = setting(MAX_PROMPTS, "Prompts in one CreateRun.", env="BRIGADE_MAX_PROMPTS",
                               low=1, high=MAX_PROMPTS)
    max_create_runs: int = setting(2, "CreateRun calls in flight at once (each may hold max_message_bytes).",
                                   env="BRIGADE_MAX_CREATE_RUNS", low=1, high=64)
    max_create_runs_per_credential: int = setting(
        1, "CreateRun calls in flight at once from one credential of the tokens file.",
        env="BRIGADE_MAX_CREATE_RUNS_PER_CREDENTIAL", low=1, high=64)
    max_runs_per_credential: int = setting(
        100, "Runs one credential of the tokens file may create (the store holds at most "
        f"{MAX_RUNS:,} in all).", env="BRIGADE_MAX_RUNS_PER_CREDENTIAL", low=1, high=MAX_RUNS)
    max_worker_ids_per_credential: int = setting(
        MAX_WORKERS_PER_RUN, "Worker ids one credential of the tokens file may have in one run (idle ones are "
        f"forgotten after an hour; a run keeps at most {MAX_WORKER_IDS_PER_RUN:,} in all).",
        env="BRIGADE_MAX_WORKER_IDS_PER_CREDENTIAL", low=1, high=MAX_WORKER_IDS_PER_RUN)
    max_streams: int = setting(256, "WatchRun streams open at once, in total (one Redis connection each).",
                               env="BRIGADE_MAX_STREAMS", low=1, high=100_000)
    max_streams_per_client: int = setting(16, "WatchRun streams open at once from one client address.",
                                          env="BRIGADE_MAX_STREAMS_PER_CLIENT", low=1, high=100_000)
    max_pulls: int = setting(32, "PullRollouts in flight at once, in total (Redis connections reserved "
                             "for them).",
                             env="BRIGADE_MAX_PULLS", low=1, high=10_000)
    max_pulls_per_client: int = setting(4, "PullRollouts in flight at once from one client address.",
                                        env="BRIGADE_MAX_PULLS_PER_CLIENT", low=1, high=10_000)
    max_rpcs: int = setting(4096, "Calls in flight at once, of every kind (gRPC's own limit).",
                            env="BRIGADE_MAX_RPCS", low=16, high=1_000_000)

    def __post_init__(self) -> None:
        validate(self)
        if self.max_request_bytes > self.max_message_bytes:
            raise ValueError("max_request_bytes cannot exceed max_message_bytes (gRPC's receive limit)")
