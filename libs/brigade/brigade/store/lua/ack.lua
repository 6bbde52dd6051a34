-- The learner's checkpoint covers these: ack the deliveries, record consumed / rejected batches,
-- move the learner step forward, keep the step's metrics.
-- KEYS: rollouts consumed rejected learner_step metrics stats events completed
-- ARGV: step metrics_json n_deliveries n_consumed learner ids...
-- FLAGS: allow-oom
-- Reply: {'ok', acked, consumed, rejected} | {'err', kind, message}
-- ids: n_deliveries delivery ids, then n_consumed consumed batch ids, then the rejected batch ids.
local ids = A.ids
local nd, nc = tonumber(A.n_deliveries), tonumber(A.n_consumed)
for i = nd + 1, #ids do
  if redis.call('SISMEMBER', K.completed, ids[i]) == 0 then
    return refuse('invalid', 'batch ' .. ids[i] .. ' was never completed in this run')
  end
end
local acked = 0
for i = 1, nd do
  acked = acked + redis.call('XACK', K.rollouts, LEARNER_GROUP, ids[i])
  redis.call('XDEL', K.rollouts, ids[i])
end
local consumed, rejected = 0, 0
for i = nd + 1, nd + nc do
  if redis.call('HEXISTS', K.rejected, ids[i]) == 0 then
    consumed = consumed + redis.call('SADD', K.consumed, ids[i])
  end
end
for i = nd + nc + 1, #ids do
  if redis.call('SISMEMBER', K.consumed, ids[i]) == 0 and redis.call('HSETNX', K.rejected, ids[i], 'learner') == 1 then
    rejected = rejected + 1
    redis.call('HINCRBY', K.stats, 'rejected', 1)
  end
end
local step = tonumber(A.step)
local old = tonumber(redis.call('GET', K.learner_step) or '-1')
if step > old then
  redis.call('SET', K.learner_step, A.step)
  -- step 0 acks only carry rejections made before the first step; no step completed
  if step > 0 then
    event(K.events, 'StepCompleted', 'step', A.step, 'consumed', fmt(nc), 'rejected', fmt(#ids - nd - nc),
          'learner', A.learner)
  end
end
if A.metrics_json ~= '' and step > tonumber(redis.call('HGET', K.stats, 'metrics_step') or '-1') then
  redis.call('HSET', K.stats, 'metrics_step', A.step)
  redis.call('XADD', K.metrics, 'MAXLEN', '~', 10000, '*', 'step', A.step, 'json', A.metrics_json)
end
return {'ok', acked, consumed, rejected}
