-- Grant a lease: work that came back first, else cut the next batch (admission and the sync
-- barrier permitting).
-- KEYS: work rollouts cursor adapter_latest learner_step workers stats events lease_deadlines lease_versions
-- KEYS: completed
-- ARGV: worker lease_prefix lease_ms batches_per_epoch total_batches capacity batches_per_step sync
-- ARGV: max_steps run worker_info lease_ttl_ms max_workers credential max_credential_workers
-- ARGV: lookahead max_lookahead publish_every
-- Reply: {'ok', 'granted', lease id, batch, attempt, version, deadline_ms}
--      | {'ok', 'finished' | 'admission' | 'sync_barrier' | 'lookahead', how far over (outstanding, or the
--        version waited for)}
--      | {'err', 'exhausted', message} (a new worker id beyond max_workers, or beyond
--        max_credential_workers of its credential)
-- total_batches 0 = unbounded; sync '1' = wait for the adapter of the previous step.
-- Lookahead: a batch is cut only while the version that will train on it is at most `lookahead`
-- versions past the newest (sync: 0, every sample on-policy). 'auto' = just enough for the learner
-- never to wait: ceil(generation / (step_busy x publish_every) x LOOKAHEAD_SLACK) from the measured
-- averages, at least 1, at most max_lookahead (the staleness cap); 1 until both are measured.
-- 'off' (topology local_sgd: trainers generate on-policy) cuts on capacity alone.
-- stats.workers counts the worker ids with state here; prune_workers.lua forgets idle ones.
-- credential '' = the proxy has one credential (one-token mode, no auth): only max_workers bounds
-- the run. Otherwise each credential's new worker ids count in stats 'workers@<credential>' (and the
-- id's `cred:` field names its credential, for the pruning), so one credential's flood of made-up
-- ids exhausts its own quota, never another's; max_workers is then the run-wide backstop.
local function lookahead_now()
  local t = redis.call('HMGET', K.stats, 'generation_ms', 'step_busy_ms', 'lookahead')
  local ahead
  if A.sync == '1' then
    ahead = 0
  elseif A.lookahead ~= 'auto' then
    ahead = tonumber(A.lookahead)
  else
    ahead = 1
    local gen, busy = tonumber(t[1] or '0'), tonumber(t[2] or '0')
    if gen > 0 and busy > 0 then
      ahead = math.ceil(gen / (busy * tonumber(A.publish_every)) * LOOKAHEAD_SLACK)
    end
    ahead = math.max(1, math.min(ahead, tonumber(A.max_lookahead)))
  end
  if t[3] ~= fmt(ahead) then redis.call('HSET', K.stats, 'lookahead', fmt(ahead)) end  -- for GetRun and ctl
  return ahead
end
local worker = A.worker
local cred = A.credential
local new_worker = redis.call('HEXISTS', K.workers, 'info:' .. worker) == 0
if new_worker then
  if cred ~= '' and tonumber(redis.call('HGET', K.stats, 'workers@' .. cred) or '0') >= tonumber(A.max_credential_workers) then
    return refuse('exhausted', 'credential ' .. cred .. ' has ' .. A.max_credential_workers .. ' worker ids in this run, ' ..
                  'the most one credential keeps; idle ones are forgotten after an hour')
  end
  if tonumber(redis.call('HGET', K.stats, 'workers') or '0') >= tonumber(A.max_workers) then
    return refuse('exhausted', 'this run has ' .. A.max_workers .. ' worker ids, the most it keeps; ' ..
                  'idle ones are forgotten after an hour')
  end
end
local max_steps = tonumber(A.max_steps)
if max_steps > 0 and tonumber(redis.call('GET', K.learner_step) or '0') >= max_steps then
  return {'ok', 'finished', 0}
end
local latest = tonumber(redis.call('GET', K.adapter_latest) or '0')
local id, batch, attempt
-- work that came back (failed, expired, revoked) first: it is already counted as outstanding
local r = redis.call('XREADGROUP', 'GROUP', WORK_GROUP, worker, 'COUNT', 1, 'STREAMS', K.work, '>')
if r then
  local e = r[1][2][1]
  local f = tomap(e[2])
  id, batch, attempt = e[1], f['batch'], tonumber(f['attempt'])
else
  local n = tonumber(redis.call('GET', K.cursor) or '0')
  local bpe = tonumber(A.batches_per_epoch)
  local function batch_at(i) return string.format(BATCH_ID_FORMAT, A.run, math.floor(i / bpe), i % bpe) end
  -- a batch the learner trained though a Redis crash lost its cut is completed already (ack.lua):
  -- passed over, not cut again (ack.lua bounds how many lie ahead)
  while redis.call('SISMEMBER', K.completed, batch_at(n)) == 1 do
    n = n + 1
  end
  local total = tonumber(A.total_batches)
  local queued = redis.call('XLEN', K.work)
  if total > 0 and n >= total then
    if queued == 0 then return {'ok', 'finished', 0} end
    return {'ok', 'admission', queued}    -- every batch is cut; some may still come back
  end
  local outstanding = queued + redis.call('XLEN', K.rollouts)
  if outstanding >= tonumber(A.capacity) then return {'ok', 'admission', outstanding} end
  if A.lookahead ~= 'off' then
    local trains_at = math.floor(math.floor(n / tonumber(A.batches_per_step)) / tonumber(A.publish_every))
    local ahead = lookahead_now()
    if trains_at - latest > ahead then
      return {'ok', A.sync == '1' and 'sync_barrier' or 'lookahead', trains_at - ahead}
    end
  end
  redis.call('SET', K.cursor, fmt(n + 1))
  batch = batch_at(n)
  attempt = 1
  redis.call('XADD', K.work, '*', 'batch', batch, 'attempt', '1', 'failures', '0')
  r = redis.call('XREADGROUP', 'GROUP', WORK_GROUP, worker, 'COUNT', 1, 'STREAMS', K.work, '>')
  id = r[1][2][1][1]
end
local now = now_ms()
local deadline = now + tonumber(A.lease_ms)
local lk = A.lease_prefix .. id
redis.call('HSET', lk, 'worker', worker, 'batch', batch, 'attempt', fmt(attempt), 'version', fmt(latest),
           'deadline_ms', fmt(deadline), 'granted_ms', fmt(now))
redis.call('PEXPIRE', lk, A.lease_ttl_ms)
-- the janitor finds expired and stale leases through these, without reading every lease
redis.call('ZADD', K.lease_deadlines, deadline, id)
redis.call('ZADD', K.lease_versions, latest, id)
redis.call('HINCRBY', K.workers, 'granted:' .. worker, 1)
redis.call('HSET', K.workers, 'seen:' .. worker, fmt(now))
if redis.call('HSET', K.workers, 'info:' .. worker, A.worker_info) == 1 then
  redis.call('HINCRBY', K.stats, 'workers', 1)
  if cred ~= '' then
    redis.call('HSET', K.workers, 'cred:' .. worker, cred)
    redis.call('HINCRBY', K.stats, 'workers@' .. cred, 1)
  end
  event(K.events, 'WorkerSeen', 'worker', worker)
end
event(K.events, 'LeaseGranted', 'lease', id, 'batch', batch, 'attempt', fmt(attempt), 'worker', worker,
      'version', fmt(latest))
return {'ok', 'granted', id, batch, attempt, latest, deadline}
