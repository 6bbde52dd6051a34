-- Record an adapter version (never overwritten) and move `adapter_latest` forward, never back.
-- Redis keeps the newest ADAPTERS_KEPT versions' manifests (and their evaluator results): a version
-- that old is far past any staleness cap, and the bucket keeps every version.
-- KEYS: adapters adapter_latest events evals stats
-- ARGV: version manifest uri step step_busy_ms
-- Reply: {'ok', latest version} | {'err', 'exists' | 'invalid', message}
-- A new version is exactly latest + 1 (an older one may still be recorded, an identical one
-- republished): a version far ahead would make every lease ask for an adapter that never comes.
-- The caller keeps versions below 2^53, so Lua's doubles hold them exactly.
local old = redis.call('HGET', K.adapters, A.version)
if old and old ~= A.manifest then
  return refuse('exists', 'adapter version ' .. A.version ..
                ' was already published with a different manifest; versions are never overwritten')
end
local latest = tonumber(redis.call('GET', K.adapter_latest) or '0')
if not old and tonumber(A.version) > latest + 1 then
  return refuse('invalid', 'adapter version ' .. A.version .. ' skips ahead of the latest, ' .. fmt(latest) ..
                '; publish ' .. fmt(latest + 1) .. ' next')
end
if not old then
  redis.call('HSET', K.adapters, A.version, A.manifest)
  local gone = fmt(tonumber(A.version) - ADAPTERS_KEPT)
  redis.call('HDEL', K.adapters, gone)
  redis.call('HDEL', K.evals, gone)
  if tonumber(A.version) > latest then
    latest = tonumber(A.version)
    redis.call('SET', K.adapter_latest, A.version)
  end
  event(K.events, 'AdapterPublished', 'version', A.version, 'step', A.step, 'uri', A.uri)
  -- the learner's busy time per step (0 = it did not say): automatic lookahead's yardstick
  if tonumber(A.step_busy_ms) > 0 then average_ms(K.stats, 'step_busy_ms', tonumber(A.step_busy_ms)) end
end
return {'ok', latest}
