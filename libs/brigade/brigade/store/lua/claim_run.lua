-- Count a run against the quota of the credential creating it (the proxy's tokens file), before
-- it is created: runs per credential. A run id claimed already (by this credential or another) is
-- not counted again; a claim whose CreateRun then failed stays counted against its own credential
-- (a flood of bad requests uses up the flooder's quota, nobody else's). A global key, a script of
-- its own, as register_run.lua.
-- KEYS: owners
-- ARGV: run credential max_runs
-- Reply: {'ok', 1 claimed now | 0 claimed already} | {'err', 'exhausted', message}
if redis.call('HEXISTS', K.owners, 'run:' .. A.run) == 1 then return {'ok', 0} end
local n = tonumber(redis.call('HGET', K.owners, 'n:' .. A.credential) or '0')
if n >= tonumber(A.max_runs) then
  return refuse('exhausted', 'credential ' .. A.credential .. ' has created ' .. A.max_runs ..
                ' runs, the most one credential may (the proxy\'s --max-runs-per-credential)')
end
redis.call('HSET', K.owners, 'run:' .. A.run, A.credential)
redis.call('HINCRBY', K.owners, 'n:' .. A.credential, 1)
return {'ok', 1}
