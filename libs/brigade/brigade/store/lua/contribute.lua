-- topology local_sgd: complete every lease of a trainer's round at once and queue its contribution
-- on `contributions` for the aggregator. All or nothing: one lease that is not the trainer's any
-- more (expired, revoked, another worker's) refuses the whole contribution, and nothing changes.
-- KEYS: work contributions completed stats workers events lease_deadlines lease_versions
-- ARGV: worker lease_prefix contribution base_version manifest n ids...
-- Reply: {'ok', 'submitted', delivery id} | {'ok', 'duplicate'} | {'err', kind, message}
-- ids: n lease ids, then the n batch ids they were granted for, in the same order.
local worker, n, ids = A.worker, tonumber(A.n), A.ids
-- a retry after a lost answer: the first try completed every batch (a batch is completed once)
local done = 0
for i = n + 1, 2 * n do
  if redis.call('SISMEMBER', K.completed, ids[i]) == 1 or compacted(K.stats, ids[i]) then done = done + 1 end
end
if done == n then
  redis.call('HINCRBY', K.stats, 'duplicates', 1)
  return {'ok', 'duplicate'}
end
for i = 1, n do
  local id, batch = ids[i], ids[n + i]
  local h = redis.call('HMGET', A.lease_prefix .. id, 'worker', 'batch', 'expired', 'revoked')
  if not h[1] then return refuse('failed_precondition', 'lease ' .. id .. ' is gone (expired and requeued, or never granted)') end
  if h[1] ~= worker then return refuse('failed_precondition', 'lease ' .. id .. ' is held by another worker') end
  if h[2] ~= batch then
    return refuse('invalid', 'batch_ids[' .. fmt(i - 1) .. '] ' .. batch .. ' is not the batch of lease ' .. id .. ', ' .. h[2])
  end
  if h[4] then return refuse('failed_precondition', 'lease ' .. id .. ' was revoked (its adapter version is too stale)') end
  if h[3] or not pending_for(K.work, id, worker) then
    return refuse('failed_precondition', 'lease ' .. id .. ' expired and the batch was requeued')
  end
  if redis.call('SISMEMBER', K.completed, batch) == 1 then
    return refuse('failed_precondition', 'batch ' .. batch .. ' was already completed')
  end
end
local now = now_ms()
for i = 1, n do
  redis.call('XACK', K.work, WORK_GROUP, ids[i])
  redis.call('XDEL', K.work, ids[i])
  redis.call('DEL', A.lease_prefix .. ids[i])
  unindex(K.lease_deadlines, K.lease_versions, ids[i])
  redis.call('SADD', K.completed, ids[n + i])
end
local rid = redis.call('XADD', K.contributions, '*', 'contribution', A.contribution, 'version', A.base_version,
                       'worker', worker, 'm', A.manifest)
redis.call('HINCRBY', K.stats, 'completed', n)
redis.call('HINCRBY', K.workers, 'completed:' .. worker, n)
redis.call('HSET', K.workers, 'seen:' .. worker, fmt(now))
event(K.events, 'ContributionSubmitted', 'contribution', A.contribution, 'worker', worker, 'version', A.base_version,
      'batches', fmt(n), 'delivery', rid)
return {'ok', 'submitted', rid}
