-- List a run id in the run index, before the run's own keys are written (a run that exists is
-- always listed, so the janitor sweeps it). The index is a global key: on Redis Cluster it lives in
-- its own slot, so this is a script of its own, never one with a run's keys.
-- KEYS: index
-- ARGV: run max_runs
-- Reply: {'ok', 1 listed now | 0 listed already} | {'err', 'exhausted', message}
if redis.call('ZSCORE', K.index, A.run) then return {'ok', 0} end
if redis.call('ZCARD', K.index) >= tonumber(A.max_runs) then
  return refuse('exhausted', 'this Redis holds ' .. A.max_runs .. ' runs, the most it takes; delete old runs first')
end
redis.call('ZADD', K.index, 0, A.run)
return {'ok', 1}
