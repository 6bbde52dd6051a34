-- Consumers (one per worker id, one per learner id) stay in a group forever unless deleted; spot
-- fleets mint new worker ids all day. Drop the given ones (the caller picked those idle for long,
-- a slice at a time, so one call never holds Redis long) if they still hold nothing: checking
-- `pending` and deleting in one script matters, DELCONSUMER discards a consumer's pending entries,
-- which must never be a lease granted in between. With forget_workers '1' the worker's stats go
-- too, and stats.workers (the per-run cap's count) goes down, and its credential's count
-- (stats 'workers@<credential>', acquire.lua).
-- KEYS: stream workers stats
-- ARGV: group forget_workers names...
-- FLAGS: allow-oom
-- Reply: {'ok', consumers removed}
local removed = 0
for _, name in ipairs(A.names) do
  if #redis.call('XPENDING', K.stream, A.group, '-', '+', 1, name) == 0 then
    redis.call('XGROUP', 'DELCONSUMER', K.stream, A.group, name)
    removed = removed + 1
    if A.forget_workers == '1' then
      local cred = redis.call('HGET', K.workers, 'cred:' .. name)
      redis.call('HDEL', K.workers, 'seen:' .. name, 'granted:' .. name, 'completed:' .. name, 'cred:' .. name)
      if cred and redis.call('HINCRBY', K.stats, 'workers@' .. cred, -1) <= 0 then
        redis.call('HDEL', K.stats, 'workers@' .. cred)
      end
      if redis.call('HDEL', K.workers, 'info:' .. name) == 1 and redis.call('HINCRBY', K.stats, 'workers', -1) < 0 then
        redis.call('HSET', K.stats, 'workers', 0)
      end
    end
  end
end
return {'ok', removed}
