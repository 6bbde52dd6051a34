-- Store a run: the prompts (staged under `staged` by the caller), the spec, the consumer groups (rollouts and contributions share the learner group name).
-- The caller listed the run in the run index first (register_run.lua).
-- KEYS: spec prompts staged work rollouts contributions stats events
-- ARGV: spec_bytes now
-- Reply: {'ok', 'created'} | {'ok', 'exists', existing spec bytes}
local existing = redis.call('GET', K.spec)
if existing then
  redis.call('DEL', K.staged)
  return {'ok', 'exists', existing}
end
redis.call('RENAME', K.staged, K.prompts)
redis.call('PERSIST', K.prompts)
redis.call('SET', K.spec, A.spec_bytes)
redis.pcall('XGROUP', 'CREATE', K.work, WORK_GROUP, '0', 'MKSTREAM')
redis.pcall('XGROUP', 'CREATE', K.rollouts, LEARNER_GROUP, '0', 'MKSTREAM')
redis.pcall('XGROUP', 'CREATE', K.contributions, LEARNER_GROUP, '0', 'MKSTREAM')
redis.call('HSET', K.stats, 'created_ms', A.now)
event(K.events, 'RunCreated', 'prompts', fmt(redis.call('LLEN', K.prompts)))
return {'ok', 'created'}
