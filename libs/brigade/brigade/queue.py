"""Every Redis Streams operation of brigade, in one place (used by the proxy and the janitor).

State of a run (keys from `brigade.keys.RunKeys`):

- `work`: stream with consumer group `rollout`. An entry is one attempt at one batch
  (`batch`, `attempt`, `failures`); while it is pending in the group it IS a lease, and its entry
  id is the lease id. Completed, failed and expired entries are XACKed *and* XDELed, so
  `XLEN work` = queued + leased.
- `rollouts`: stream with group `learner`; one entry per completed batch (`batch`, `version`,
  `worker`, `m` = RolloutManifest bytes). Acked entries are XDELed, so `XLEN rollouts` = completed
  but not yet acked by the learner.
- `leases:{id}`: hash worker, batch, attempt, version, deadline_ms (+ `expired` / `revoked`
  flags once the janitor took it back; kept a while so the worker learns why).
- terminal states of a batch: `consumed` (set), `rejected` (hash batch -> reason), `deadletter`
  (stream). `completed` (set) holds every batch that was ever completed: it makes completion
  idempotent.

Batches are cut on demand: global index n = the `cursor` counter, epoch = n // batches_per_epoch,
index = n % batches_per_epoch; the prompts of a batch are a slice of a permutation seeded by
(spec.seed, epoch), so any proxy replica rebuilds the same batch from its id.

Every multi-key mutation is one Lua script (registered once, run with EVALSHA): cutting a batch,
granting, heartbeating, completing, failing, expiring, revoking and removing stale manifests are
atomic with respect to each other, whatever the number of proxy replicas. Scripts build lease keys
from a prefix, so this targets a standalone Redis (or one shard), not Redis Cluster.

Attempts and max_attempts: every requeue gets attempt + 1 (a new seed and a new rollout key),
but only failures count toward `max_attempts`: FailLease(ERROR), lease expiry (a silent death may
be a crash the batch causes) and revocation. FailLease(PREEMPTED) requeues without counting, since
a spot reclaim says nothing about the batch.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from google.protobuf.message import DecodeError

from brigade import keys
from brigade.config import ConfigError
from brigade.resp import PipelinedRedis, ReplyError
from brigade.spec import validate_spec
from brigade.v1 import brigade_pb2 as pb

MAX_ID_CHARS = 256            # worker, learner, lease, batch and run ids
MAX_IDS_PER_ACK = 10_000
EVENTS_MAXLEN = 10_000        # the events stream is capped (approximately) at this many entries
MAX_BLOCK_MS = 30_000         # long polls (PullRollouts, WatchRun) block at most this long per call
MAX_PULL = 1_000
LIST_LIMIT = 10_000           # inspection reads return at most this many rows
SWEEP_COUNT = 200             # entries one janitor script call looks at
CONSUMER_IDLE_MS = 3_600_000  # group consumers idle this long and holding nothing are forgotten
JANITOR_CONSUMER = "janitor"
STREAM_ID_RE = re.compile(r"^[0-9]{1,20}-[0-9]{1,20}$")
HEX64_RE = re.compile(r"^[0-9a-f]{64}$")


# ---------------------------------------------------------------- errors

class QueueError(Exception):
    """A request the queue refuses; `code` names the gRPC status the proxy answers with."""

    code = "INTERNAL"


class InvalidArgument(QueueError):
    code = "INVALID_ARGUMENT"


class NotFound(QueueError):
    code = "NOT_FOUND"


class FailedPrecondition(QueueError):
    code = "FAILED_PRECONDITION"


class AlreadyExists(QueueError):
    code = "ALREADY_EXISTS"


_ERRORS = {
    "invalid": InvalidArgument,
    "not_found": NotFound,
    "failed_precondition": FailedPrecondition,
    "exists": AlreadyExists,
}


def _raise_script_error(result: list) -> None:
    """Scripts answer {'err', kind, message} for a refusal."""
    if result and _s(result[0]) == "err":
        raise _ERRORS[_s(result[1])](_s(result[2]))


# ---------------------------------------------------------------- small helpers

def _s(value: bytes | str | int | None) -> str:
    if value is None:
        return ""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _i(value: bytes | str | int | None, default: int = 0) -> int:
    if value is None or value == b"" or value == "":
        return default
    return int(value)


def _short(value: str, limit: int = 80) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def now_ms() -> int:
    return int(time.time() * 1000)


def check_id(name: str, value: str) -> str:
    """A non-empty id of at most MAX_ID_CHARS printable characters."""
    if not value:
        raise InvalidArgument(f"{name} is required")
    if len(value) > MAX_ID_CHARS:
        raise InvalidArgument(f"{name} is {len(value)} characters long; the limit is {MAX_ID_CHARS}")
    if not value.isprintable():
        raise InvalidArgument(f"{name} {_short(value)} contains control characters")
    return value


def check_stream_id(name: str, value: str) -> str:
    check_id(name, value)
    if not STREAM_ID_RE.match(value):
        raise InvalidArgument(f"{name} {_short(value)} is not a stream entry id like '1712345678901-0'")
    return value


def check_manifest(run: str, m: pb.RolloutManifest) -> None:
    """Everything about a rollout manifest that does not depend on the lease."""
    problems = []
    if m.run_id != run:
        problems.append(f"run_id {_short(m.run_id)} does not match the request's run {run!r}")
    if not m.batch_id or len(m.batch_id) > MAX_ID_CHARS:
        problems.append("batch_id is required (at most 256 characters)")
    if m.attempt < 1:
        problems.append("attempt must be >= 1")
    expected_uri = keys.rollout_key(run, m.batch_id, m.attempt)
    if m.uri != expected_uri:
        problems.append(f"uri {_short(m.uri)} must be exactly {expected_uri!r}")
    if m.text_uri and m.text_uri != keys.rollout_text_key(run, m.batch_id, m.attempt):
        problems.append(f"text_uri {_short(m.text_uri)} must be empty or exactly "
                        f"{keys.rollout_text_key(run, m.batch_id, m.attempt)!r}")
    if not HEX64_RE.match(m.sha256):
        problems.append(f"sha256 {_short(m.sha256)} must be 64 lowercase hex characters")
    if m.num_samples < 1:
        problems.append("num_samples must be > 0")
    for name in ("reward_mean", "compute_seconds", "price_per_hour"):
        if not math.isfinite(getattr(m, name)):
            problems.append(f"{name} must be a finite number")
    if m.compute_seconds < 0 or m.price_per_hour < 0:
        problems.append("compute_seconds and price_per_hour must be >= 0")
    if problems:
        raise InvalidArgument("invalid rollout manifest: " + "; ".join(problems))


def check_adapter_manifest(run: str, m: pb.AdapterManifest) -> None:
    problems = []
    if m.run_id != run:
        problems.append(f"run_id {_short(m.run_id)} does not match the request's run {run!r}")
    if m.version < 1:
        problems.append("version must be >= 1 (0 is the base adapter, never published)")
    folder = keys.adapter_prefix(run, m.version).rstrip("/")
    uri = m.uri.rstrip("/")
    # the key itself, or a full URI (s3://bucket/prefix/..., file:///...) that ends with it
    inside = (uri == folder or uri.endswith("/" + folder)) and "/../" not in uri + "/" and "/./" not in uri + "/"
    if not inside:
        problems.append(f"uri {_short(m.uri)} must be the adapter folder {keys.adapter_prefix(run, m.version)!r} "
                        "(or a bucket URI ending with it)")
    if problems:
        raise InvalidArgument("invalid adapter manifest: " + "; ".join(problems))


def check_batch_id(run: str, value: str) -> str:
    check_id("batch id", value)
    try:
        batch_run, _, _ = keys.parse_batch_id(value)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
    if batch_run != run:
        raise InvalidArgument(f"batch id {_short(value)} belongs to another run")
    return value


# ---------------------------------------------------------------- results

@dataclass
class Grant:
    granted: bool
    reason: str = ""          # admission | sync_barrier | finished (when not granted)
    retry_after_ms: int = 0
    lease_id: str = ""
    batch_id: str = ""
    attempt: int = 0
    version: int = 0
    deadline_ms: int = 0


@dataclass
class Beat:
    status: str               # ok | lost | revoked
    message: str = ""
    deadline_ms: int = 0
    latest_version: int = 0


@dataclass
class Completion:
    duplicate: bool
    delivery_id: str = ""


@dataclass
class Failure:
    requeued: bool
    deadlettered: bool
    next_attempt: int = 0


@dataclass
class Pulled:
    rollouts: list[tuple[str, pb.RolloutManifest]]
    latest_version: int


@dataclass
class SweepResult:
    expired: int = 0
    revoked: int = 0
    stale_removed: int = 0
    deadlettered: int = 0


# ---------------------------------------------------------------- the run, as the proxy sees it

class RunInfo:
    """The immutable part of a run (spec and prompts), cached per process."""

    def __init__(self, spec: pb.RunSpec, spec_bytes: bytes, prompts: list[pb.Prompt]):
        self.spec = spec
        self.spec_bytes = spec_bytes
        self.prompts = prompts
        self.run = spec.run_id
        self.keys = keys.RunKeys(self.run)
        self.lease_prefix = self.keys.lease("")
        st = spec.staleness
        self.lease_ms = max(1, st.lease_seconds) * 1000
        self.max_attempts = max(1, st.max_attempts)
        self.max_staleness = st.max_staleness
        self.batches_per_epoch = max(1, math.ceil(len(prompts) / max(1, spec.prompts_per_batch)))
        self.total_batches = spec.epochs * self.batches_per_epoch  # 0 = unbounded
        self.capacity = max(1, spec.batches_per_step) * (st.max_staleness + 1)
        # a lease hash outlives its lease; once expired/revoked it stays a while so the worker
        # learns why on its next heartbeat instead of hearing "unknown lease"
        self.lease_ttl_ms = self.lease_ms * 2 + 60_000
        self.keep_ms = max(self.lease_ms * 4, 600_000)
        self._perms: OrderedDict[int, list[int]] = OrderedDict()

    def permutation(self, epoch: int) -> list[int]:
        """Deterministic order of the prompts in `epoch`, from (spec.seed, epoch) only.

        Fisher-Yates driven by random.random(), whose sequence for a given seed Python keeps
        stable across versions, so replicas on different Python builds agree."""
        perm = self._perms.get(epoch)
        if perm is None:
            digest = hashlib.sha256(f"brigade-epoch\0{self.spec.seed}\0{epoch}".encode()).digest()
            rng = random.Random(int.from_bytes(digest[:8], "big"))
            perm = list(range(len(self.prompts)))
            for i in range(len(perm) - 1, 0, -1):
                j = int(rng.random() * (i + 1))
                perm[i], perm[j] = perm[j], perm[i]
            self._perms[epoch] = perm
            while len(self._perms) > 4:
                self._perms.popitem(last=False)
        return perm

    def batch(self, batch_id: str) -> pb.PromptBatch:
        _, epoch, index = keys.parse_batch_id(batch_id)
        ppb = max(1, self.spec.prompts_per_batch)
        order = self.permutation(epoch)[index * ppb:(index + 1) * ppb]
        out = pb.PromptBatch(batch_id=batch_id, run_id=self.run, epoch=epoch, index=index)
        out.prompts.extend(self.prompts[i] for i in order)
        return out

    def batch_id_of(self, n: int) -> str:
        return keys.batch_id(self.run, n // self.batches_per_epoch, n % self.batches_per_epoch)


# ---------------------------------------------------------------- Lua

_LUA_COMMON = r"""
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function tomap(f)
  local m = {}
  if f then for i = 1, #f, 2 do m[f[i]] = f[i + 1] end end
  return m
end
local function event(key, maxlen, typ, ...)
  redis.call('XADD', key, 'MAXLEN', '~', maxlen, '*', 'type', typ, ...)
end
local function fmt(n) return string.format('%d', n) end
-- take a work entry back (XACK + XDEL) and requeue it as attempt+1, or dead-letter it once
-- `failures` reached max_attempts. Returns the next attempt, or 0 when dead-lettered.
local function requeue(work, deadletter, stats, events, maxlen, id, batch, attempt, failures,
                       max_attempts, worker, reason, now)
  redis.call('XACK', work, 'rollout', id)
  redis.call('XDEL', work, id)
  if failures >= max_attempts then
    redis.call('XADD', deadletter, '*', 'batch', batch, 'reason', reason, 'last_worker', worker,
               'attempts', fmt(attempt), 'time', fmt(now))
    redis.call('HINCRBY', stats, 'deadlettered', 1)
    event(events, maxlen, 'BatchDeadLettered', 'batch', batch, 'attempts', fmt(attempt),
          'reason', reason, 'worker', worker)
    return 0
  end
  redis.call('XADD', work, '*', 'batch', batch, 'attempt', fmt(attempt + 1), 'failures', fmt(failures))
  return attempt + 1
end
local function pending_for(work, id, worker)
  local p = redis.call('XPENDING', work, 'rollout', id, id, 1, worker)
  return #p > 0
end
"""

# KEYS: spec prompts tmp work rollouts runs stats events
# ARGV: spec_bytes run now
_CREATE = _LUA_COMMON + r"""
local existing = redis.call('GET', KEYS[1])
if existing then
  redis.call('DEL', KEYS[3])
  return {'exists', existing}
end
redis.call('RENAME', KEYS[3], KEYS[2])
redis.call('PERSIST', KEYS[2])
redis.call('SET', KEYS[1], ARGV[1])
redis.pcall('XGROUP', 'CREATE', KEYS[4], 'rollout', '0', 'MKSTREAM')
redis.pcall('XGROUP', 'CREATE', KEYS[5], 'learner', '0', 'MKSTREAM')
redis.call('SADD', KEYS[6], ARGV[2])
redis.call('HSET', KEYS[7], 'created_ms', ARGV[3])
event(KEYS[8], 10000, 'RunCreated', 'prompts', fmt(redis.call('LLEN', KEYS[2])))
return {'created'}
"""

# KEYS: work rollouts cursor adapter_latest learner_step workers events
# ARGV: 1 worker 2 lease_prefix 3 lease_ms 4 batches_per_epoch 5 total(0=unbounded) 6 capacity
#       7 batches_per_step 8 sync 9 max_steps 10 run 11 worker_info 12 lease_ttl_ms 13 events_maxlen
_ACQUIRE = _LUA_COMMON + r"""
local worker = ARGV[1]
local maxlen = ARGV[13]
local max_steps = tonumber(ARGV[9])
if max_steps > 0 and tonumber(redis.call('GET', KEYS[5]) or '0') >= max_steps then
  return {'no', 'finished', 0}
end
local latest = tonumber(redis.call('GET', KEYS[4]) or '0')
local id, batch, attempt
-- work that came back (failed, expired, revoked) first: it is already counted as outstanding
local r = redis.call('XREADGROUP', 'GROUP', 'rollout', worker, 'COUNT', 1, 'STREAMS', KEYS[1], '>')
if r then
  local e = r[1][2][1]
  local f = tomap(e[2])
  id, batch, attempt = e[1], f['batch'], tonumber(f['attempt'])
else
  local n = tonumber(redis.call('GET', KEYS[3]) or '0')
  local total = tonumber(ARGV[5])
  local queued = redis.call('XLEN', KEYS[1])
  if total > 0 and n >= total then
    if queued == 0 then return {'no', 'finished', 0} end
    return {'no', 'admission', queued}    -- every batch is cut; some may still come back
  end
  local outstanding = queued + redis.call('XLEN', KEYS[2])
  if outstanding >= tonumber(ARGV[6]) then return {'no', 'admission', outstanding} end
  if ARGV[8] == '1' and latest < math.floor(n / tonumber(ARGV[7])) then
    return {'no', 'sync_barrier', math.floor(n / tonumber(ARGV[7]))}
  end
  redis.call('SET', KEYS[3], fmt(n + 1))
  local bpe = tonumber(ARGV[4])
  batch = ARGV[10] .. ':' .. fmt(math.floor(n / bpe)) .. ':' .. fmt(n % bpe)
  attempt = 1
  redis.call('XADD', KEYS[1], '*', 'batch', batch, 'attempt', '1', 'failures', '0')
  r = redis.call('XREADGROUP', 'GROUP', 'rollout', worker, 'COUNT', 1, 'STREAMS', KEYS[1], '>')
  id = r[1][2][1][1]
end
local now = now_ms()
local deadline = now + tonumber(ARGV[3])
local lk = ARGV[2] .. id
redis.call('HSET', lk, 'worker', worker, 'batch', batch, 'attempt', fmt(attempt), 'version', fmt(latest),
           'deadline_ms', fmt(deadline), 'granted_ms', fmt(now))
redis.call('PEXPIRE', lk, ARGV[12])
redis.call('HINCRBY', KEYS[6], 'granted:' .. worker, 1)
redis.call('HSET', KEYS[6], 'seen:' .. worker, fmt(now))
if redis.call('HSET', KEYS[6], 'info:' .. worker, ARGV[11]) == 1 then
  event(KEYS[7], maxlen, 'WorkerSeen', 'worker', worker)
end
event(KEYS[7], maxlen, 'LeaseGranted', 'lease', id, 'batch', batch, 'attempt', fmt(attempt),
      'worker', worker, 'version', fmt(latest))
return {'ok', id, batch, attempt, latest, deadline}
"""

# KEYS: lease work adapter_latest workers
# ARGV: 1 lease_id 2 worker 3 lease_ms 4 lease_ttl_ms
_HEARTBEAT = _LUA_COMMON + r"""
local latest = tonumber(redis.call('GET', KEYS[3]) or '0')
local h = redis.call('HMGET', KEYS[1], 'worker', 'revoked', 'expired')
if not h[1] then return {'lost', 'unknown lease ' .. ARGV[1] .. ' (never granted, finished, or long gone)', 0, latest} end
if h[1] ~= ARGV[2] then return {'lost', 'lease ' .. ARGV[1] .. ' is held by another worker', 0, latest} end
if h[2] then return {'revoked', 'lease revoked: its adapter version is too stale to be consumed; discard the work', 0, latest} end
if h[3] or not pending_for(KEYS[2], ARGV[1], ARGV[2]) then
  return {'lost', 'lease expired and requeued', 0, latest}
end
redis.call('XCLAIM', KEYS[2], 'rollout', ARGV[2], 0, ARGV[1], 'JUSTID')
local now = now_ms()
local deadline = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], 'deadline_ms', fmt(deadline))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
redis.call('HSET', KEYS[4], 'seen:' .. ARGV[2], fmt(now))
return {'ok', '', deadline, latest}
"""

# KEYS: lease work rollouts completed stats workers events
# ARGV: 1 lease_id 2 worker 3 m.batch 4 m.attempt 5 m.policy_version 6 manifest 7 events_maxlen
_COMPLETE = _LUA_COMMON + r"""
local id, worker, mbatch = ARGV[1], ARGV[2], ARGV[3]
local h = redis.call('HMGET', KEYS[1], 'worker', 'batch', 'attempt', 'version', 'expired', 'revoked')
if not h[1] then
  if redis.call('SISMEMBER', KEYS[4], mbatch) == 1 then
    redis.call('HINCRBY', KEYS[5], 'duplicates', 1)
    return {'duplicate'}
  end
  return {'err', 'not_found', 'unknown lease ' .. id .. ' (never granted, or long gone)'}
end
if h[1] ~= worker then
  return {'err', 'failed_precondition', 'lease ' .. id .. ' is held by another worker'}
end
if h[2] ~= mbatch then
  return {'err', 'invalid', 'manifest batch_id ' .. mbatch .. ' does not match the leased batch ' .. h[2]}
end
if h[3] ~= ARGV[4] then
  return {'err', 'invalid', 'manifest attempt ' .. ARGV[4] .. ' does not match the lease attempt ' .. h[3]}
end
if h[4] ~= ARGV[5] then
  return {'err', 'invalid', 'manifest policy_version ' .. ARGV[5] .. ' does not match the leased adapter version ' .. h[4]}
end
local pending = pending_for(KEYS[2], id, worker)
if redis.call('SISMEMBER', KEYS[4], mbatch) == 1 then
  if pending and not h[5] and not h[6] then
    redis.call('XACK', KEYS[2], 'rollout', id)
    redis.call('XDEL', KEYS[2], id)
    redis.call('DEL', KEYS[1])
  end
  redis.call('HINCRBY', KEYS[5], 'duplicates', 1)
  return {'duplicate'}
end
if h[5] then return {'err', 'failed_precondition', 'lease ' .. id .. ' expired (not heartbeated in time) and the batch was requeued'} end
if h[6] then return {'err', 'failed_precondition', 'lease ' .. id .. ' was revoked (its adapter version is too stale)'} end
if not pending then return {'err', 'failed_precondition', 'lease ' .. id .. ' expired and the batch was requeued'} end
local now = now_ms()
redis.call('XACK', KEYS[2], 'rollout', id)
redis.call('XDEL', KEYS[2], id)
local rid = redis.call('XADD', KEYS[3], '*', 'batch', mbatch, 'version', ARGV[5], 'worker', worker, 'm', ARGV[6])
redis.call('SADD', KEYS[4], mbatch)
redis.call('DEL', KEYS[1])
redis.call('HINCRBY', KEYS[5], 'completed', 1)
redis.call('HINCRBY', KEYS[6], 'completed:' .. worker, 1)
redis.call('HSET', KEYS[6], 'seen:' .. worker, fmt(now))
event(KEYS[7], ARGV[7], 'RolloutCompleted', 'lease', id, 'batch', mbatch, 'attempt', ARGV[4],
      'worker', worker, 'version', ARGV[5], 'delivery', rid)
return {'ok', rid}
"""

# KEYS: lease work deadletter stats events
# ARGV: 1 lease_id 2 worker 3 counted(0|1) 4 max_attempts 5 reason 6 events_maxlen 7 kind
_FAIL = _LUA_COMMON + r"""
local id, worker = ARGV[1], ARGV[2]
local h = redis.call('HMGET', KEYS[1], 'worker', 'expired', 'revoked')
if not h[1] then return {'err', 'not_found', 'unknown lease ' .. id .. ' (never granted, finished, or long gone)'} end
if h[1] ~= worker then return {'err', 'failed_precondition', 'lease ' .. id .. ' is held by another worker'} end
if h[2] or h[3] or not pending_for(KEYS[2], id, worker) then
  return {'err', 'failed_precondition', 'lease ' .. id .. ' is no longer held: it ' ..
          (h[3] and 'was revoked' or 'expired') .. ' and the batch was requeued'}
end
local e = redis.call('XRANGE', KEYS[2], id, id)
local f = tomap(e[1] and e[1][2])
redis.call('DEL', KEYS[1])
if not f['batch'] then
  redis.call('XACK', KEYS[2], 'rollout', id)
  return {'err', 'failed_precondition', 'lease ' .. id .. ' has no work entry any more'}
end
local attempt = tonumber(f['attempt'] or '1')
local failures = tonumber(f['failures'] or '0') + tonumber(ARGV[3])
local now = now_ms()
redis.call('HINCRBY', KEYS[4], 'failed', 1)
event(KEYS[5], ARGV[6], 'LeaseFailed', 'lease', id, 'batch', f['batch'], 'attempt', fmt(attempt),
      'worker', worker, 'reason', ARGV[7])
local nxt = requeue(KEYS[2], KEYS[3], KEYS[4], KEYS[5], ARGV[6], id, f['batch'], attempt, failures,
                    tonumber(ARGV[4]), worker, ARGV[5], now)
return {'ok', nxt}
"""

# KEYS: work deadletter stats events
# ARGV: 1 min_idle_ms 2 start 3 count 4 max_attempts 5 lease_prefix 6 keep_ms 7 events_maxlen
_EXPIRE = _LUA_COMMON + r"""
local res = redis.call('XAUTOCLAIM', KEYS[1], 'rollout', 'janitor', ARGV[1], ARGV[2], 'COUNT', ARGV[3])
local now = now_ms()
local expired, dead = 0, 0
for _, e in ipairs(res[2]) do
  local id = e[1]
  if not e[2] then
    redis.call('XACK', KEYS[1], 'rollout', id)   -- Redis < 7: entry deleted but still pending
  else
    local f = tomap(e[2])
    local lk = ARGV[5] .. id
    local worker = redis.call('HGET', lk, 'worker') or ''
    if worker ~= '' then
      redis.call('HSET', lk, 'expired', '1')
      redis.call('PEXPIRE', lk, ARGV[6])
    end
    local attempt = tonumber(f['attempt'] or '1')
    redis.call('HINCRBY', KEYS[3], 'expired', 1)
    event(KEYS[4], ARGV[7], 'LeaseExpired', 'lease', id, 'batch', f['batch'], 'attempt', fmt(attempt),
          'worker', worker)
    local nxt = requeue(KEYS[1], KEYS[2], KEYS[3], KEYS[4], ARGV[7], id, f['batch'], attempt,
                        tonumber(f['failures'] or '0') + 1, tonumber(ARGV[4]), worker, 'lease expired', now)
    expired = expired + 1
    if nxt == 0 then dead = dead + 1 end
  end
end
return {res[1], expired, dead}
"""

# KEYS: work adapter_latest deadletter stats events
# ARGV: 1 max_staleness 2 start 3 count 4 max_attempts 5 lease_prefix 6 keep_ms 7 events_maxlen
_REVOKE = _LUA_COMMON + r"""
local latest = tonumber(redis.call('GET', KEYS[2]) or '0')
local ms = tonumber(ARGV[1])
if latest <= ms then return {'0-0', 0, 0} end
local count = tonumber(ARGV[3])
local p = redis.call('XPENDING', KEYS[1], 'rollout', ARGV[2], '+', count)
local now = now_ms()
local revoked, dead = 0, 0
for _, row in ipairs(p) do
  local id = row[1]
  local lk = ARGV[5] .. id
  local h = redis.call('HMGET', lk, 'version', 'worker')
  if h[1] and latest - tonumber(h[1]) > ms then
    local e = redis.call('XRANGE', KEYS[1], id, id)
    local f = tomap(e[1] and e[1][2])
    local attempt = tonumber(f['attempt'] or '1')
    redis.call('HSET', lk, 'revoked', '1')
    redis.call('PEXPIRE', lk, ARGV[6])
    redis.call('HINCRBY', KEYS[4], 'revoked', 1)
    event(KEYS[5], ARGV[7], 'LeaseRevoked', 'lease', id, 'batch', f['batch'] or '', 'attempt', fmt(attempt),
          'worker', h[2] or '', 'version', h[1], 'latest', fmt(latest))
    if f['batch'] then
      local nxt = requeue(KEYS[1], KEYS[3], KEYS[4], KEYS[5], ARGV[7], id, f['batch'], attempt,
                          tonumber(f['failures'] or '0') + 1, tonumber(ARGV[4]), h[2] or '',
                          'revoked: adapter version too stale', now)
      if nxt == 0 then dead = dead + 1 end
    else
      redis.call('XACK', KEYS[1], 'rollout', id)
    end
    revoked = revoked + 1
  end
end
local nxt = '0-0'
if #p >= count then nxt = '(' .. p[#p][1] end
return {nxt, revoked, dead}
"""

# Only manifests the learner has not been handed yet (after the group's last-delivered id) are
# removed: one the learner holds is its to consume or reject, so a batch never ends both.
# KEYS: rollouts adapter_latest rejected stats events
# ARGV: 1 max_staleness 2 count 3 events_maxlen 4 start ('' = after the last delivered entry)
_STALE = _LUA_COMMON + r"""
local latest = tonumber(redis.call('GET', KEYS[2]) or '0')
local ms = tonumber(ARGV[1])
if latest <= ms then return {0, ''} end
local start = ARGV[4]
if start == '' then
  local last = '0-0'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local m = tomap(g)
    if m['name'] == 'learner' then last = m['last-delivered-id'] end
  end
  start = '(' .. last
  if last == '0-0' then start = '-' end
end
local count = tonumber(ARGV[2])
local entries = redis.call('XRANGE', KEYS[1], start, '+', 'COUNT', count)
local removed = 0
for _, e in ipairs(entries) do
  local f = tomap(e[2])
  local v = tonumber(f['version'] or '0')
  if latest - v > ms then
    redis.call('XDEL', KEYS[1], e[1])
    redis.call('HSETNX', KEYS[3], f['batch'], 'stale (janitor)')
    redis.call('HINCRBY', KEYS[4], 'stale_removed', 1)
    event(KEYS[5], ARGV[3], 'RolloutRejected', 'batch', f['batch'], 'version', f['version'] or '0',
          'latest', fmt(latest), 'reason', 'stale (janitor)')
    removed = removed + 1
  end
end
local nxt = ''
if #entries >= count then nxt = '(' .. entries[#entries][1] end
return {removed, nxt}
"""

# Consumers (one per worker id, one per learner id) stay in a group forever unless deleted; spot
# fleets mint new worker ids all day. Drop the ones idle for long that hold nothing. Checking
# `pending` and deleting in one script matters: DELCONSUMER discards a consumer's pending entries,
# which must never be a lease granted in between.
# KEYS: stream   ARGV: 1 group 2 min_idle_ms
_PRUNE = r"""
local removed = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local m = {}
  for i = 1, #c, 2 do m[c[i]] = c[i + 1] end
  if tonumber(m['pending']) == 0 and tonumber(m['idle']) > tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], m['name'])
    removed = removed + 1
  end
end
return removed
"""

# KEYS: rollouts consumed rejected learner_step metrics stats events completed
# ARGV: 1 step 2 metrics_json 3 n_deliveries 4 n_consumed 5 n_rejected 6 learner 7 events_maxlen, ids...
_ACK = _LUA_COMMON + r"""
local nd, nc, nr = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local base = 7
for i = base + nd + 1, base + nd + nc + nr do
  if redis.call('SISMEMBER', KEYS[8], ARGV[i]) == 0 then
    return {'err', 'invalid', 'batch ' .. ARGV[i] .. ' was never completed in this run'}
  end
end
local acked = 0
for i = base + 1, base + nd do
  acked = acked + redis.call('XACK', KEYS[1], 'learner', ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
end
local consumed, rejected = 0, 0
for i = base + nd + 1, base + nd + nc do
  if redis.call('HEXISTS', KEYS[3], ARGV[i]) == 0 then
    consumed = consumed + redis.call('SADD', KEYS[2], ARGV[i])
  end
end
for i = base + nd + nc + 1, base + nd + nc + nr do
  if redis.call('SISMEMBER', KEYS[2], ARGV[i]) == 0 and redis.call('HSETNX', KEYS[3], ARGV[i], 'learner') == 1 then
    rejected = rejected + 1
    redis.call('HINCRBY', KEYS[6], 'rejected', 1)
  end
end
local step = tonumber(ARGV[1])
local old = tonumber(redis.call('GET', KEYS[4]) or '-1')
if step > old then
  redis.call('SET', KEYS[4], ARGV[1])
  -- step 0 acks only carry rejections made before the first step; no step completed
  if step > 0 then
    event(KEYS[7], ARGV[7], 'StepCompleted', 'step', ARGV[1], 'consumed', fmt(nc), 'rejected', fmt(nr),
          'learner', ARGV[6])
  end
end
if ARGV[2] ~= '' and step > tonumber(redis.call('HGET', KEYS[6], 'metrics_step') or '-1') then
  redis.call('HSET', KEYS[6], 'metrics_step', ARGV[1])
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', 10000, '*', 'step', ARGV[1], 'json', ARGV[2])
end
return {'ok', acked, consumed, rejected}
"""

# KEYS: adapters adapter_latest events
# ARGV: 1 version 2 manifest 3 uri 4 step 5 events_maxlen
_PUBLISH = _LUA_COMMON + r"""
local old = redis.call('HGET', KEYS[1], ARGV[1])
if old and old ~= ARGV[2] then
  return {'err', 'exists', 'adapter version ' .. ARGV[1] .. ' was already published with a different manifest; versions are never overwritten'}
end
local latest = tonumber(redis.call('GET', KEYS[2]) or '0')
if not old then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  if tonumber(ARGV[1]) > latest then
    latest = tonumber(ARGV[1])
    redis.call('SET', KEYS[2], ARGV[1])
  end
  event(KEYS[3], ARGV[5], 'AdapterPublished', 'version', ARGV[1], 'step', ARGV[4], 'uri', ARGV[3])
end
return {'ok', latest}
"""

# KEYS: lock   ARGV: owner ttl_ms
_LOCK_RENEW = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_LOCK_RELEASE = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


# ---------------------------------------------------------------- the queue

class _Script:
    """A Lua script run with EVALSHA: over the pipelined hot-path connection when there is one,
    else through redis-py. Loaded into Redis on first NOSCRIPT (after a restart or a flush)."""

    def __init__(self, client: aioredis.Redis, fast: PipelinedRedis | None, source: str):
        self.source = source
        self.sha = hashlib.sha1(source.encode()).hexdigest()
        self._fast = fast
        self._script = client.register_script(source)

    async def __call__(self, keys: Sequence[str], args: Sequence[object]):
        fast = self._fast
        if fast is None:
            return await self._script(keys=keys, args=args)
        try:
            return await fast.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except ReplyError as e:
            if not str(e).startswith("NOSCRIPT"):
                raise
        await fast.execute("SCRIPT", "LOAD", self.source)
        return await fast.execute("EVALSHA", self.sha, len(keys), *keys, *args)


class Queue:
    """Async access to brigade's Redis state. One per process; safe to share between tasks.

    `redis` serves short commands; `blocking` (a separate pool) serves the long polls
    (PullRollouts, WatchRun), so a hundred waiting learners or watchers never starve leases."""

    def __init__(self, redis_url: str, *, max_connections: int = 128, blocking_connections: int = 256,
                 pipelined: bool = True):
        pool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=max_connections, timeout=10)
        bpool = aioredis.BlockingConnectionPool.from_url(redis_url, max_connections=blocking_connections, timeout=10)
        self.redis_url = redis_url
        self.redis = aioredis.Redis(connection_pool=pool)
        self.blocking = aioredis.Redis(connection_pool=bpool)
        # the scripts (every lease operation) go over one auto-pipelined connection when the URL allows
        self.fast = PipelinedRedis(redis_url) if pipelined and PipelinedRedis.supports(redis_url) else None
        self._runs: dict[str, RunInfo] = {}
        r, f = self.redis, self.fast
        self._create = _Script(r, f, _CREATE)
        self._acquire = _Script(r, f, _ACQUIRE)
        self._heartbeat = _Script(r, f, _HEARTBEAT)
        self._complete = _Script(r, f, _COMPLETE)
        self._fail = _Script(r, f, _FAIL)
        self._expire = _Script(r, f, _EXPIRE)
        self._revoke = _Script(r, f, _REVOKE)
        self._stale = _Script(r, f, _STALE)
        self._ack = _Script(r, f, _ACK)
        self._publish = _Script(r, f, _PUBLISH)
        self._prune = _Script(r, f, _PRUNE)
        self._lock_renew = _Script(r, f, _LOCK_RENEW)
        self._lock_release = _Script(r, f, _LOCK_RELEASE)

    async def close(self) -> None:
        if self.fast is not None:
            await self.fast.close()
        await self.redis.aclose()
        await self.blocking.aclose()
        await self.redis.connection_pool.disconnect()
        await self.blocking.connection_pool.disconnect()

    async def ping(self) -> bool:
        return bool(await self.redis.ping())

    # -------------------------------------------------------------- runs

    async def run_ids(self) -> list[str]:
        return sorted(_s(r) for r in await self.redis.smembers(keys.RUNS_SET))

    async def run(self, run: str) -> RunInfo:
        """The cached spec and prompts of `run`; NotFound with the known runs if there is none."""
        info = self._runs.get(run)
        if info is not None:
            return info
        check_id("run_id", run)
        k = keys.RunKeys(run)
        async with self.redis.pipeline(transaction=False) as p:
            p.get(k.spec)
            p.lrange(k.prompts, 0, -1)
            spec_bytes, prompt_list = await p.execute()
        if not spec_bytes:
            known = await self.run_ids()
            shown = ", ".join(known[:20]) + (", ..." if len(known) > 20 else "") if known else "none"
            raise NotFound(f"no run {_short(run)} (known: {shown})")
        spec = pb.RunSpec.FromString(spec_bytes)
        prompts = [pb.Prompt.FromString(b) for b in prompt_list]
        info = RunInfo(spec, spec_bytes, prompts)
        self._runs[run] = info
        return info

    async def run_exists(self, run: str) -> bool:
        return run in self._runs or bool(await self.redis.exists(keys.RunKeys(run).spec))

    def forget_runs(self) -> None:
        self._runs.clear()

    @staticmethod
    def validate_run(spec: pb.RunSpec, prompts: Sequence[pb.Prompt]) -> None:
        try:
            validate_spec(spec)
        except ConfigError as e:
            raise InvalidArgument(str(e)) from None
        if not prompts:
            raise InvalidArgument("a run needs at least one prompt (CreateRunRequest.prompts is empty)")

    async def create_run(self, spec: pb.RunSpec, prompts: Sequence[pb.Prompt], exist_ok: bool = False) -> bool:
        """Store the spec and prompts and create the consumer groups. True if created, False if
        an identical run existed and exist_ok; AlreadyExists for a different spec."""
        self.validate_run(spec, prompts)
        run = spec.run_id
        k = keys.RunKeys(run)
        spec_bytes = spec.SerializeToString(deterministic=True)
        existing = await self.redis.get(k.spec)
        if existing is None:
            tmp = f"{k.prompts}:tmp:{uuid.uuid4().hex}"
            async with self.redis.pipeline(transaction=False) as p:
                for i in range(0, len(prompts), 1000):
                    p.rpush(tmp, *(x.SerializeToString(deterministic=True) for x in prompts[i:i + 1000]))
                p.pexpire(tmp, 600_000)
                await p.execute()
            res = await self._create(
                keys=[k.spec, k.prompts, tmp, k.work, k.rollouts, keys.RUNS_SET, k.stats, k.events],
                args=[spec_bytes, run, now_ms()],
            )
            if _s(res[0]) == "created":
                return True
            existing = res[1]
        if existing == spec_bytes:
            if exist_ok:
                return False
            raise AlreadyExists(f"run {run!r} already exists (pass exist_ok to accept an identical spec)")
        raise AlreadyExists(f"run {run!r} already exists with a different spec; pick a new run_id")

    # -------------------------------------------------------------- leases

    async def acquire(self, run: str, worker: str, worker_info: bytes = b"") -> Grant:
        info = await self.run(run)
        k, spec = info.keys, info.spec
        res = await self._acquire(
            keys=[k.work, k.rollouts, k.cursor, k.adapter_latest, k.learner_step, k.workers, k.events],
            args=[worker, info.lease_prefix, info.lease_ms, info.batches_per_epoch, info.total_batches,
                  info.capacity, max(1, spec.batches_per_step), int(spec.sync), spec.max_steps, run,
                  worker_info, info.lease_ttl_ms, EVENTS_MAXLEN],
        )
        if _s(res[0]) == "ok":
            return Grant(True, lease_id=_s(res[1]), batch_id=_s(res[2]), attempt=int(res[3]),
                         version=int(res[4]), deadline_ms=int(res[5]))
        reason = _s(res[1])
        if reason == "finished":
            retry = 5_000
        elif reason == "sync_barrier":
            retry = 250 + random.randint(0, 250)
        else:  # admission: back off longer the further over capacity we are
            over = int(res[2]) / max(1, info.capacity)
            retry = min(1_000, int(200 * max(1.0, over))) + random.randint(0, 200)
        return Grant(False, reason=reason, retry_after_ms=retry)

    async def heartbeat(self, run: str, lease_id: str, worker: str) -> Beat:
        info = await self.run(run)
        k = info.keys
        res = await self._heartbeat(
            keys=[k.lease(lease_id), k.work, k.adapter_latest, k.workers],
            args=[lease_id, worker, info.lease_ms, info.lease_ttl_ms],
        )
        return Beat(_s(res[0]), _s(res[1]), int(res[2]), int(res[3]))

    async def complete(self, run: str, lease_id: str, worker: str, manifest: pb.RolloutManifest) -> Completion:
        info = await self.run(run)
        check_manifest(run, manifest)
        k = info.keys
        res = await self._complete(
            keys=[k.lease(lease_id), k.work, k.rollouts, k.completed, k.stats, k.workers, k.events],
            args=[lease_id, worker, manifest.batch_id, manifest.attempt, manifest.policy_version,
                  manifest.SerializeToString(), EVENTS_MAXLEN],
        )
        _raise_script_error(res)
        if _s(res[0]) == "duplicate":
            return Completion(True)
        return Completion(False, _s(res[1]))

    async def fail(self, run: str, lease_id: str, worker: str, *, preempted: bool, message: str = "") -> Failure:
        info = await self.run(run)
        k = info.keys
        kind = "preempted" if preempted else "error"
        reason = kind + (f": {message[:500]}" if message else "")
        res = await self._fail(
            keys=[k.lease(lease_id), k.work, k.deadletter, k.stats, k.events],
            args=[lease_id, worker, 0 if preempted else 1, info.max_attempts, reason, EVENTS_MAXLEN, kind],
        )
        _raise_script_error(res)
        nxt = int(res[1])
        return Failure(requeued=nxt > 0, deadlettered=nxt == 0, next_attempt=nxt)

    # -------------------------------------------------------------- learner

    async def pull(self, run: str, learner: str, max_manifests: int, wait_ms: int = 0,
                   include_pending: bool = False) -> Pulled:
        info = await self.run(run)
        k = info.keys
        count = max(1, min(max_manifests or 1, MAX_PULL))
        out: list[tuple[str, pb.RolloutManifest]] = []
        if include_pending:
            res = await self.redis.xreadgroup(keys.LEARNER_GROUP, learner, {k.rollouts: "0"}, count=count)
            out = await self._decode_rollouts(k, res)
        if not out:
            wait = max(0, min(wait_ms, MAX_BLOCK_MS))
            client = self.blocking if wait else self.redis
            res = await client.xreadgroup(keys.LEARNER_GROUP, learner, {k.rollouts: ">"}, count=count,
                                          block=wait or None)
            out = await self._decode_rollouts(k, res)
        latest = _i(await self.redis.get(k.adapter_latest))
        return Pulled(out, latest)

    async def _decode_rollouts(self, k: keys.RunKeys, res) -> list[tuple[str, pb.RolloutManifest]]:
        out, gone = [], []
        for _stream, entries in res or []:
            for entry_id, fields in entries:
                if not fields or b"m" not in fields:  # deleted after delivery (stale removal)
                    gone.append(entry_id)
                    continue
                out.append((_s(entry_id), pb.RolloutManifest.FromString(fields[b"m"])))
        if gone:
            await self.redis.xack(k.rollouts, keys.LEARNER_GROUP, *gone)
        return out

    async def ack(self, run: str, learner: str, delivery_ids: Sequence[str], consumed: Sequence[str],
                  rejected: Sequence[str], step: int, metrics_json: str = "") -> int:
        info = await self.run(run)
        if len(delivery_ids) + len(consumed) + len(rejected) > MAX_IDS_PER_ACK:
            raise InvalidArgument(f"at most {MAX_IDS_PER_ACK} ids per AckRollouts")
        for d in delivery_ids:
            check_stream_id("delivery id", d)
        for b in (*consumed, *rejected):
            check_batch_id(run, b)
        k = info.keys
        res = await self._ack(
            keys=[k.rollouts, k.consumed, k.rejected, k.learner_step, k.metrics, k.stats, k.events, k.completed],
            args=[step, metrics_json, len(delivery_ids), len(consumed), len(rejected), learner, EVENTS_MAXLEN,
                  *delivery_ids, *consumed, *rejected],
        )
        _raise_script_error(res)
        return int(res[1])

    async def publish(self, run: str, manifest: pb.AdapterManifest) -> int:
        info = await self.run(run)
        check_adapter_manifest(run, manifest)
        k = info.keys
        res = await self._publish(
            keys=[k.adapters, k.adapter_latest, k.events],
            args=[manifest.version, manifest.SerializeToString(deterministic=True), manifest.uri, manifest.step,
                  EVENTS_MAXLEN],
        )
        _raise_script_error(res)
        return int(res[1])

    async def latest_version(self, run: str) -> int:
        return _i(await self.redis.get(keys.RunKeys(run).adapter_latest))

    # -------------------------------------------------------------- janitor sweeps

    async def expire_leases(self, run: str, min_idle_ms: int | None = None) -> SweepResult:
        """Requeue (or dead-letter) every lease not heartbeated for lease_seconds."""
        info = await self.run(run)
        k = info.keys
        out = SweepResult()
        start = "0-0"
        while True:
            res = await self._expire(
                keys=[k.work, k.deadletter, k.stats, k.events],
                args=[info.lease_ms if min_idle_ms is None else min_idle_ms, start, SWEEP_COUNT,
                      info.max_attempts, info.lease_prefix, info.keep_ms, EVENTS_MAXLEN],
            )
            out.expired += int(res[1])
            out.deadlettered += int(res[2])
            start = _s(res[0])
            if start == "0-0":
                return out

    async def revoke_stale(self, run: str) -> SweepResult:
        """Revoke in-flight leases whose adapter version is more than max_staleness behind."""
        info = await self.run(run)
        k = info.keys
        out = SweepResult()
        start = "-"
        while True:
            res = await self._revoke(
                keys=[k.work, k.adapter_latest, k.deadletter, k.stats, k.events],
                args=[info.max_staleness, start, SWEEP_COUNT, info.max_attempts, info.lease_prefix,
                      info.keep_ms, EVENTS_MAXLEN],
            )
            out.revoked += int(res[1])
            out.deadlettered += int(res[2])
            start = _s(res[0])
            if start == "0-0":
                return out

    async def remove_stale_manifests(self, run: str) -> SweepResult:
        """Drop completed manifests, not yet handed to the learner, that are too stale to train on."""
        info = await self.run(run)
        k = info.keys
        removed, start = 0, ""
        while True:
            res = await self._stale(keys=[k.rollouts, k.adapter_latest, k.rejected, k.stats, k.events],
                                    args=[info.max_staleness, SWEEP_COUNT, EVENTS_MAXLEN, start])
            removed += int(res[0])
            start = _s(res[1])
            if not start:
                return SweepResult(stale_removed=removed)

    async def prune_consumers(self, run: str, min_idle_ms: int = CONSUMER_IDLE_MS) -> int:
        """Forget group consumers (worker / learner ids) idle for `min_idle_ms` that hold nothing."""
        k = (await self.run(run)).keys
        return (int(await self._prune(keys=[k.work], args=[keys.WORK_GROUP, min_idle_ms]))
                + int(await self._prune(keys=[k.rollouts], args=[keys.LEARNER_GROUP, min_idle_ms])))

    async def sweep(self, run: str) -> SweepResult:
        a = await self.expire_leases(run)
        b = await self.revoke_stale(run)
        c = await self.remove_stale_manifests(run)
        return SweepResult(a.expired, b.revoked, c.stale_removed, a.deadlettered + b.deadlettered)

    # -------------------------------------------------------------- singleton lock

    async def lock_acquire(self, name: str, owner: str, ttl_ms: int) -> bool:
        return bool(await self.redis.set(name, owner, nx=True, px=ttl_ms))

    async def lock_renew(self, name: str, owner: str, ttl_ms: int) -> bool:
        return bool(await self._lock_renew(keys=[name], args=[owner, ttl_ms]))

    async def lock_release(self, name: str, owner: str) -> bool:
        return bool(await self._lock_release(keys=[name], args=[owner]))

    async def lock_holder(self, name: str) -> str:
        return _s(await self.redis.get(name))

    # -------------------------------------------------------------- inspection

    async def run_state(self, run: str) -> pb.RunState:
        info = await self.run(run)
        k = info.keys
        async with self.redis.pipeline(transaction=False) as p:
            p.get(k.cursor)
            p.xlen(k.work)
            p.xpending(k.work, keys.WORK_GROUP)
            p.xlen(k.rollouts)
            p.scard(k.consumed)
            p.hgetall(k.stats)
            p.get(k.adapter_latest)
            p.get(k.learner_step)
            p.xlen(k.deadletter)
            cursor, work_len, pending, rollouts_len, consumed, stats, latest, step, dead = await p.execute()
        stats = {_s(a): _i(b) for a, b in stats.items()}
        leased = int(pending["pending"]) if pending else 0
        cut = _i(cursor)
        step_n = _i(step)
        finished = (info.spec.max_steps > 0 and step_n >= info.spec.max_steps) or (
            info.total_batches > 0 and cut >= info.total_batches and work_len == 0 and rollouts_len == 0)
        return pb.RunState(
            spec=info.spec, latest_version=_i(latest), learner_step=step_n, batches_created=cut,
            queued=max(0, work_len - leased), leased=leased, completed=rollouts_len, consumed=consumed,
            rejected=stats.get("rejected", 0), revoked=stats.get("revoked", 0), expired=stats.get("expired", 0),
            deadlettered=dead, stale_removed=stats.get("stale_removed", 0),
            duplicates=stats.get("duplicates", 0), created_ms=stats.get("created_ms", 0),
            num_prompts=len(info.prompts), finished=finished,
        )

    async def list_leases(self, run: str) -> list[pb.LeaseInfo]:
        info = await self.run(run)
        k = info.keys
        rows = await self.redis.xpending_range(k.work, keys.WORK_GROUP, "-", "+", LIST_LIMIT)
        if not rows:
            return []
        async with self.redis.pipeline(transaction=False) as p:
            for row in rows:
                p.hgetall(k.lease(_s(row["message_id"])))
            hashes = await p.execute()
        out = []
        for row, h in zip(rows, hashes, strict=True):
            h = {_s(a): _s(b) for a, b in h.items()}
            out.append(pb.LeaseInfo(
                lease_id=_s(row["message_id"]), batch_id=h.get("batch", ""),
                worker_id=h.get("worker") or _s(row["consumer"]), adapter_version=_i(h.get("version")),
                attempt=_i(h.get("attempt")), deadline_ms=_i(h.get("deadline_ms")), revoked="revoked" in h,
            ))
        return out

    async def list_workers(self, run: str) -> list[pb.WorkerInfo]:
        info = await self.run(run)
        raw = await self.redis.hgetall(info.keys.workers)
        workers: dict[str, pb.WorkerInfo] = {}
        for field, value in raw.items():
            kind, _, wid = _s(field).partition(":")
            w = workers.setdefault(wid, pb.WorkerInfo(worker_id=wid))
            if kind == "info":
                try:
                    w.MergeFromString(value)
                except DecodeError:
                    pass
                w.worker_id = wid
            elif kind == "granted":
                w.leases_granted = _i(value)
            elif kind == "completed":
                w.leases_completed = _i(value)
            elif kind == "seen":
                w.last_seen_ms = _i(value)
        return [workers[w] for w in sorted(workers)]

    async def list_adapters(self, run: str) -> list[pb.AdapterInfo]:
        info = await self.run(run)
        async with self.redis.pipeline(transaction=False) as p:
            p.hgetall(info.keys.adapters)
            p.hgetall(info.keys.evals)
            adapters, evals = await p.execute()
        evals = {_s(a): _s(b) for a, b in evals.items()}
        out = []
        for version, raw in adapters.items():
            m = pb.AdapterManifest.FromString(raw)
            out.append(pb.AdapterInfo(version=m.version, step=m.step, uri=m.uri, created_ms=m.created_ms,
                                      payload=m.payload, eval_json=evals.get(_s(version), "")))
        return sorted(out, key=lambda a: a.version)

    async def metrics(self, run: str, last: int = 0) -> list[pb.StepMetrics]:
        info = await self.run(run)
        k = info.keys
        if last > 0:
            rows = list(reversed(await self.redis.xrevrange(k.metrics, "+", "-", count=min(last, LIST_LIMIT))))
        else:
            rows = await self.redis.xrange(k.metrics, "-", "+", count=LIST_LIMIT)
        return [pb.StepMetrics(step=_i(f.get(b"step")), metrics_json=_s(f.get(b"json"))) for _, f in rows]

    async def dead_letters(self, run: str) -> list[pb.DeadLetter]:
        info = await self.run(run)
        rows = await self.redis.xrange(info.keys.deadletter, "-", "+", count=LIST_LIMIT)
        return [pb.DeadLetter(batch_id=_s(f.get(b"batch")), reason=_s(f.get(b"reason")),
                              last_worker=_s(f.get(b"last_worker")), attempts=_i(f.get(b"attempts")),
                              time_ms=_i(f.get(b"time"))) for _, f in rows]

    async def events(self, run: str, after_id: str = "", from_start: bool = False,
                     block_ms: int = 5_000) -> AsyncIterator[pb.Event]:
        """Tail the run's events: from the beginning, after `after_id`, or only new ones."""
        info = await self.run(run)
        k = info.keys
        if from_start:
            last = "0-0"
        elif after_id:
            last = check_stream_id("after_id", after_id)
        else:
            tail = await self.redis.xrevrange(k.events, "+", "-", count=1)
            last = _s(tail[0][0]) if tail else "0-0"
        block = max(1, min(block_ms, MAX_BLOCK_MS))
        while True:
            res = await self.blocking.xread({k.events: last}, count=500, block=block)
            for _stream, entries in res or []:
                for entry_id, fields in entries:
                    last = _s(entry_id)
                    yield event_from_fields(run, last, fields)

    async def read_events(self, run: str, after_id: str = "0-0", count: int = 1000) -> list[pb.Event]:
        k = keys.RunKeys(run)
        start = "-" if after_id in ("", "0-0") else "(" + after_id
        rows = await self.redis.xrange(k.events, start, "+", count=count)
        return [event_from_fields(run, _s(i), f) for i, f in rows]


def event_from_fields(run: str, entry_id: str, fields: dict) -> pb.Event:
    attrs = {_s(a): _s(b) for a, b in fields.items()}
    typ = attrs.pop("type", "")
    return pb.Event(id=entry_id, run_id=run, type=typ, time_ms=int(entry_id.split("-")[0]), attrs=attrs)
