-- A worker gives a lease back: requeue the batch, or dead-letter it after max_attempts failures.
-- KEYS: lease work deadletter stats events lease_deadlines lease_versions
-- ARGV: lease_id worker counted max_attempts reason kind
-- FLAGS: allow-oom
-- Reply: {'ok', next attempt (0 = dead-lettered)} | {'err', kind, message}
-- counted '1' = the failure counts toward max_attempts (ERROR), '0' = it does not (PREEMPTED).
local id, worker = A.lease_id, A.worker
local h = redis.call('HMGET', K.lease, 'worker', 'expired', 'revoked')
if not h[1] then return refuse('not_found', 'unknown lease ' .. id .. ' (never granted, finished, or long gone)') end
if h[1] ~= worker then return refuse('failed_precondition', 'lease ' .. id .. ' is held by another worker') end
if h[2] or h[3] or not pending_for(K.work, id, worker) then
  return refuse('failed_precondition', 'lease ' .. id .. ' is no longer held: it ' ..
                (h[3] and 'was revoked' or 'expired') .. ' and the batch was requeued')
end
local e = redis.call('XRANGE', K.work, id, id)
local f = tomap(e[1] and e[1][2])
redis.call('DEL', K.lease)
unindex(K.lease_deadlines, K.lease_versions, id)
if not f['batch'] then
  redis.call('XACK', K.work, WORK_GROUP, id)
  return refuse('failed_precondition', 'lease ' .. id .. ' has no work entry any more')
end
local attempt = tonumber(f['attempt'] or '1')
local failures = tonumber(f['failures'] or '0') + tonumber(A.counted)
local now = now_ms()
redis.call('HINCRBY', K.stats, 'failed', 1)
event(K.events, 'LeaseFailed', 'lease', id, 'batch', f['batch'], 'attempt', fmt(attempt), 'worker', worker,
      'reason', A.kind)
local nxt = requeue(K.work, K.deadletter, K.stats, K.events, id, f['batch'], attempt, failures,
                    tonumber(A.max_attempts), worker, A.reason, now)
return {'ok', nxt}
