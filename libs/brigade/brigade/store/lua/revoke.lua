-- Revoke (and requeue) up to `count` leases whose adapter version is more than max_staleness
-- behind the latest, found through the version index: a sweep reads only the stale ones.
-- KEYS: work adapter_latest deadletter stats events lease_deadlines lease_versions
-- ARGV: max_staleness count max_attempts lease_prefix keep_ms
-- FLAGS: allow-oom
-- Reply: {'ok', 'more' | '' (done), revoked, dead-lettered}
local latest = tonumber(redis.call('GET', K.adapter_latest) or '0')
local ms = tonumber(A.max_staleness)
if latest <= ms then return {'ok', '', 0, 0} end
local count = tonumber(A.count)
local stale = redis.call('ZRANGEBYSCORE', K.lease_versions, '-inf', latest - ms - 1, 'LIMIT', 0, count)
local now = now_ms()
local revoked, dead = 0, 0
for _, id in ipairs(stale) do
  unindex(K.lease_deadlines, K.lease_versions, id)
  local p = redis.call('XPENDING', K.work, WORK_GROUP, id, id, 1)
  if #p > 0 then  -- still a lease (else it ended and only the index remembered it)
    local lk = A.lease_prefix .. id
    local h = redis.call('HMGET', lk, 'version', 'worker')
    local e = redis.call('XRANGE', K.work, id, id)
    local f = tomap(e[1] and e[1][2])
    local attempt = tonumber(f['attempt'] or '1')
    local worker = h[2] or p[1][2]
    if h[1] then
      redis.call('HSET', lk, 'revoked', '1')
      redis.call('PEXPIRE', lk, A.keep_ms)
    end
    redis.call('HINCRBY', K.stats, 'revoked', 1)
    event(K.events, 'LeaseRevoked', 'lease', id, 'batch', f['batch'] or '', 'attempt', fmt(attempt),
          'worker', worker, 'version', h[1] or '', 'latest', fmt(latest))
    if f['batch'] then
      local nxt = requeue(K.work, K.deadletter, K.stats, K.events, id, f['batch'], attempt,
                          tonumber(f['failures'] or '0') + 1, tonumber(A.max_attempts), worker,
                          'revoked: adapter version too stale', now)
      if nxt == 0 then dead = dead + 1 end
    else
      redis.call('XACK', K.work, WORK_GROUP, id)
    end
    revoked = revoked + 1
  end
end
return {'ok', #stale >= count and 'more' or '', revoked, dead}
