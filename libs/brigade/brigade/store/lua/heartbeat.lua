-- Extend a lease, or say why it is no longer the worker's.
-- KEYS: lease work adapter_latest workers lease_deadlines
-- ARGV: lease_id worker lease_ms lease_ttl_ms
-- FLAGS: allow-oom
-- Reply: {'ok', 'ok' | 'lost' | 'revoked', message, deadline_ms, latest version}
local id, worker = A.lease_id, A.worker
local latest = tonumber(redis.call('GET', K.adapter_latest) or '0')
local h = redis.call('HMGET', K.lease, 'worker', 'revoked', 'expired')
if not h[1] then return {'ok', 'lost', 'unknown lease ' .. id .. ' (never granted, finished, or long gone)', 0, latest} end
if h[1] ~= worker then return {'ok', 'lost', 'lease ' .. id .. ' is held by another worker', 0, latest} end
if h[2] then
  return {'ok', 'revoked', 'lease revoked: its adapter version is too stale to be consumed; discard the work', 0, latest}
end
if h[3] or not pending_for(K.work, id, worker) then
  return {'ok', 'lost', 'lease expired and requeued', 0, latest}
end
redis.call('XCLAIM', K.work, WORK_GROUP, worker, 0, id, 'JUSTID')
local now = now_ms()
local deadline = now + tonumber(A.lease_ms)
redis.call('HSET', K.lease, 'deadline_ms', fmt(deadline))
redis.call('PEXPIRE', K.lease, A.lease_ttl_ms)
redis.call('ZADD', K.lease_deadlines, deadline, id)
redis.call('HSET', K.workers, 'seen:' .. worker, fmt(now))
return {'ok', 'ok', '', deadline, latest}
