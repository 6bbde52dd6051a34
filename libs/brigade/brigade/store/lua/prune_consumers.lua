-- Consumers (one per worker id, one per learner id) stay in a group forever unless deleted; spot
-- fleets mint new worker ids all day. Drop the ones idle for long that hold nothing. Checking
-- `pending` and deleting in one script matters: DELCONSUMER discards a consumer's pending entries,
-- which must never be a lease granted in between.
-- KEYS: stream
-- ARGV: group min_idle_ms
-- FLAGS: allow-oom
-- Reply: {'ok', consumers removed}
local removed = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', K.stream, A.group)) do
  local m = tomap(c)
  if tonumber(m['pending']) == 0 and tonumber(m['idle']) > tonumber(A.min_idle_ms) then
    redis.call('XGROUP', 'DELCONSUMER', K.stream, A.group, m['name'])
    removed = removed + 1
  end
end
return {'ok', removed}
