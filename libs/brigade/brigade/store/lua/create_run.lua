-- Store a run: the prompts (staged under `staged` by the caller), the spec, the consumer groups.
-- KEYS: spec prompts staged work rollouts contributions runs stats events
-- ARGV: spec_bytes run now max_runs
-- Reply: {'ok', 'created'} | {'ok', 'exists', existing spec bytes} | {'err', 'exhausted', message}
local existing = redis.call('GET', K.spec)
if existing then
  redis.call('DEL', K.staged)
  return {'ok', 'exists', existing}
end
if redis.call('SCARD', K.runs) >= tonumber(A.max_runs) then
  redis.call('DEL', K.staged)
  return refuse('exhausted', 'this Redis holds ' .. A.max_runs .. ' runs, the most it takes; delete old runs first')
end
redis.call('RENAME', K.staged, K.prompts)
redis.call('PERSIST', K.prompts)
redis.call('SET', K.spec, A.spec_bytes)
redis.pcall('XGROUP', 'CREATE', K.work, WORK_GROUP, '0', 'MKSTREAM')
redis.pcall('XGROUP', 'CREATE', K.rollouts, LEARNER_GROUP, '0', 'MKSTREAM')
redis.pcall('XGROUP', 'CREATE', K.contributions, LEARNER_GROUP, '0', 'MKSTREAM')
redis.call('SADD', K.runs, A.run)
redis.call('HSET', K.stats, 'created_ms', A.now)
event(K.events, 'RunCreated', 'prompts', fmt(redis.call('LLEN', K.prompts)))
return {'ok', 'created'}
