"""brigade's Redis state, split by role (used by the proxy, the janitor and the evaluator).

    store = Store(redis_url)
    store.runs      create a run; its cached spec and prompts (runs.py)
    store.leases    acquire, heartbeat, complete, fail (leases.py)
    store.learner   pull, ack, publish (learner.py)
    store.sweeps    the janitor's expiry, revocation, stale removal, consumer pruning, lock (sweeps.py)
    store.views     what RunService and `brigade ctl` read (views.py)

Request fields are checked by `brigade.wire` (the wire contract, beside the spec) before anything
reaches Redis; refusals are the StoreErrors of `brigade.errors`, named after their gRPC status.

State of a run (keys from `brigade.keys.RunKeys`):

- `work`: stream with consumer group `keys.WORK_GROUP`. An entry is one attempt at one batch
  (`batch`, `attempt`, `failures`); while it is pending in the group it IS a lease, and its entry
  id is the lease id. Completed, failed and expired entries are XACKed *and* XDELed, so
  `XLEN work` = queued + leased.
- `rollouts`: stream with group `keys.LEARNER_GROUP`; one entry per completed batch (`batch`,
  `version`, `worker`, `m` = RolloutManifest bytes). Acked entries are XDELed, so `XLEN rollouts` =
  completed but not yet acked by the learner.
- `leases:<id>`: hash worker, batch, attempt, version, deadline_ms (+ `expired` / `revoked`
  flags once the janitor took it back; kept a while so the worker learns why).
- terminal states of a batch: `consumed` (set), `rejected` (hash batch -> reason), `deadletter`
  (stream). `completed` (set) holds every batch that was ever completed: it makes completion
  idempotent.

Batches are cut on demand: global index n = the `cursor` counter, epoch = n // batches_per_epoch,
index = n % batches_per_epoch, id `keys.BATCH_ID_FORMAT`; the prompts of a batch are a slice of a
permutation seeded by (spec.seed, epoch), so any proxy replica rebuilds the same batch from its id.

Every multi-key mutation is one Lua script (lua/*.lua, registered once, run with EVALSHA): cutting
a batch, granting, heartbeating, completing, failing, expiring, revoking and removing stale
manifests are atomic with respect to each other, whatever the number of proxy replicas. A script
touches the keys of one run only, which share a hash slot (the `{run}` tag of `brigade.keys`), so the
same scripts run on one Redis and on Redis Cluster; lease keys built from a prefix inside a script
are in that slot too. The run index is global and has a script of its own (register_run).

Attempts and max_attempts: every requeue gets attempt + 1 (a new seed and a new rollout key),
but only failures count toward `max_attempts`: FailLease(ERROR), lease expiry (a silent death may
be a crash the batch causes) and revocation. FailLease(PREEMPTED) requeues without counting, since
a spot reclaim says nothing about the batch.
"""

from __future__ import annotations

from brigade.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound, StoreError
from brigade.redis_clients import async_client
from brigade.resp import pipelined_client
from brigade.store.learner import MAX_BLOCK_MS, Learner
from brigade.store.leases import Leases
from brigade.store.runs import RunInfo, Runs
from brigade.store.scripts import Scripts
from brigade.store.sweeps import SweepResult, Sweeps
from brigade.store.views import Views

__all__ = ["AlreadyExists", "FailedPrecondition", "InvalidArgument", "NotFound", "RunInfo", "Store", "StoreError",
           "SweepResult"]


class Store:
    """The connections and the role objects over them. One per process; safe to share between tasks.

    Three redis-py pools (`brigade.redis_clients`, socket timeouts fit for each): `redis` serves
    short commands; `blocking` serves WatchRun's long polls; `pulls` is reserved for PullRollouts,
    so no number of watchers can starve the learner, and neither starves leases. The scripts
    (every lease operation) go over one auto-pipelined connection (`brigade.resp`; one per master
    on Redis Cluster) when `pipelined` and the URL allow, else through redis-py. A
    `redis+cluster://` URL makes every client a cluster client (`brigade.redis_clients`)."""

    def __init__(self, redis_url: str, *, max_connections: int = 128, blocking_connections: int = 256,
                 pull_connections: int = 32, pipelined: bool = True):
        block_s = MAX_BLOCK_MS / 1000
        self.redis_url = redis_url
        self.redis = async_client(redis_url, max_connections)
        self.blocking = async_client(redis_url, blocking_connections, block_s)
        self.pulls = async_client(redis_url, pull_connections, block_s)
        self.fast = pipelined_client(redis_url) if pipelined else None
        self.scripts = scripts = Scripts(self.redis, self.fast)
        self.runs = Runs(self.redis, scripts)
        self.leases = Leases(self.runs, scripts)
        self.learner = Learner(self.redis, self.pulls, self.runs, scripts)
        self.sweeps = Sweeps(self.redis, self.runs, scripts)
        self.views = Views(self.redis, self.blocking, self.runs)

    async def close(self) -> None:
        if self.fast is not None:
            await self.fast.close()
        for client in (self.redis, self.blocking, self.pulls):
            await client.aclose()
            pool = getattr(client, "connection_pool", None)  # a cluster client closed its nodes' pools
            if pool is not None:
                await pool.disconnect()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())
