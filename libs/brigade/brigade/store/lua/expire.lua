-- Requeue (or dead-letter) up to `count` leases whose deadline has passed (not heartbeated for
-- lease_seconds), found through the deadline index, so a sweep reads only what expired, however
-- many leases are in flight. `grace_ms` moves the cut: a lease expires when deadline <= now + grace
-- (0 for the janitor; tests pass lease_ms to expire a lease at once).
-- KEYS: work deadletter stats events lease_deadlines lease_versions
-- ARGV: grace_ms count max_attempts lease_prefix keep_ms
-- FLAGS: allow-oom
-- Reply: {'ok', 'more' | '' (done), expired, dead-lettered}
local now = now_ms()
local count = tonumber(A.count)
local due = redis.call('ZRANGEBYSCORE', K.lease_deadlines, '-inf', now + tonumber(A.grace_ms), 'LIMIT', 0, count)
local expired, dead = 0, 0
for _, id in ipairs(due) do
  unindex(K.lease_deadlines, K.lease_versions, id)
  local p = redis.call('XPENDING', K.work, WORK_GROUP, id, id, 1)
  local e = redis.call('XRANGE', K.work, id, id)
  if #p > 0 and not e[1] then
    redis.call('XACK', K.work, WORK_GROUP, id)   -- entry deleted but still pending: nothing to requeue
  elseif #p > 0 then
    local f = tomap(e[1][2])
    local lk = A.lease_prefix .. id
    local worker = redis.call('HGET', lk, 'worker') or p[1][2]
    if redis.call('EXISTS', lk) == 1 then
      redis.call('HSET', lk, 'expired', '1')
      redis.call('PEXPIRE', lk, A.keep_ms)
    end
    local attempt = tonumber(f['attempt'] or '1')
    redis.call('HINCRBY', K.stats, 'expired', 1)
    event(K.events, 'LeaseExpired', 'lease', id, 'batch', f['batch'], 'attempt', fmt(attempt), 'worker', worker)
    local nxt = requeue(K.work, K.deadletter, K.stats, K.events, id, f['batch'], attempt,
                        tonumber(f['failures'] or '0') + 1, tonumber(A.max_attempts), worker, 'lease expired', now)
    expired = expired + 1
    if nxt == 0 then dead = dead + 1 end
  end
end
return {'ok', #due >= count and 'more' or '', expired, dead}
