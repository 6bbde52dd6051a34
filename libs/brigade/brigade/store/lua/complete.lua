-- Turn a lease into a completed manifest on `rollouts`, exactly once per batch.
-- KEYS: lease work rollouts completed stats workers events lease_deadlines lease_versions
-- ARGV: lease_id worker batch attempt policy_version manifest
-- Reply: {'ok', 'completed', delivery id} | {'ok', 'duplicate'} | {'err', kind, message}
local id, worker, mbatch = A.lease_id, A.worker, A.batch
local h = redis.call('HMGET', K.lease, 'worker', 'batch', 'attempt', 'version', 'expired', 'revoked', 'granted_ms')
if not h[1] then
  if redis.call('SISMEMBER', K.completed, mbatch) == 1 or compacted(K.stats, mbatch) then
    redis.call('HINCRBY', K.stats, 'duplicates', 1)
    return {'ok', 'duplicate'}
  end
  return refuse('not_found', 'unknown lease ' .. id .. ' (never granted, or long gone)')
end
if h[1] ~= worker then
  return refuse('failed_precondition', 'lease ' .. id .. ' is held by another worker')
end
if h[2] ~= mbatch then
  return refuse('invalid', 'manifest batch_id ' .. mbatch .. ' does not match the leased batch ' .. h[2])
end
if h[3] ~= A.attempt then
  return refuse('invalid', 'manifest attempt ' .. A.attempt .. ' does not match the lease attempt ' .. h[3])
end
if h[4] ~= A.policy_version then
  return refuse('invalid', 'manifest policy_version ' .. A.policy_version ..
                ' does not match the leased adapter version ' .. h[4])
end
local pending = pending_for(K.work, id, worker)
if redis.call('SISMEMBER', K.completed, mbatch) == 1 or compacted(K.stats, mbatch) then
  if pending and not h[5] and not h[6] then
    redis.call('XACK', K.work, WORK_GROUP, id)
    redis.call('XDEL', K.work, id)
    redis.call('DEL', K.lease)
    unindex(K.lease_deadlines, K.lease_versions, id)
  end
  redis.call('HINCRBY', K.stats, 'duplicates', 1)
  return {'ok', 'duplicate'}
end
if h[5] then
  return refuse('failed_precondition', 'lease ' .. id .. ' expired (not heartbeated in time) and the batch was requeued')
end
if h[6] then return refuse('failed_precondition', 'lease ' .. id .. ' was revoked (its adapter version is too stale)') end
if not pending then return refuse('failed_precondition', 'lease ' .. id .. ' expired and the batch was requeued') end
local now = now_ms()
redis.call('XACK', K.work, WORK_GROUP, id)
redis.call('XDEL', K.work, id)
local rid = redis.call('XADD', K.rollouts, '*', 'batch', mbatch, 'version', A.policy_version, 'worker', worker,
                       'm', A.manifest)
redis.call('SADD', K.completed, mbatch)
redis.call('DEL', K.lease)
unindex(K.lease_deadlines, K.lease_versions, id)
redis.call('HINCRBY', K.stats, 'completed', 1)
if h[7] then average_ms(K.stats, 'generation_ms', math.max(1, now - tonumber(h[7]))) end
redis.call('HINCRBY', K.workers, 'completed:' .. worker, 1)
redis.call('HSET', K.workers, 'seen:' .. worker, fmt(now))
event(K.events, 'RolloutCompleted', 'lease', id, 'batch', mbatch, 'attempt', A.attempt, 'worker', worker,
      'version', A.policy_version, 'delivery', rid)
return {'ok', 'completed', rid}
