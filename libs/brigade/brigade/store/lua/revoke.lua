-- Revoke (and requeue) up to `count` leases whose adapter version is more than max_staleness
-- behind the latest.
-- KEYS: work adapter_latest deadletter stats events
-- ARGV: max_staleness cursor count max_attempts lease_prefix keep_ms
-- FLAGS: allow-oom
-- Reply: {'ok', next cursor ('' = done), revoked, dead-lettered}
local latest = tonumber(redis.call('GET', K.adapter_latest) or '0')
local ms = tonumber(A.max_staleness)
if latest <= ms then return {'ok', '', 0, 0} end
local start = A.cursor
if start == '' then start = '-' end
local count = tonumber(A.count)
local p = redis.call('XPENDING', K.work, WORK_GROUP, start, '+', count)
local now = now_ms()
local revoked, dead = 0, 0
for _, row in ipairs(p) do
  local id = row[1]
  local lk = A.lease_prefix .. id
  local h = redis.call('HMGET', lk, 'version', 'worker')
  if h[1] and latest - tonumber(h[1]) > ms then
    local e = redis.call('XRANGE', K.work, id, id)
    local f = tomap(e[1] and e[1][2])
    local attempt = tonumber(f['attempt'] or '1')
    redis.call('HSET', lk, 'revoked', '1')
    redis.call('PEXPIRE', lk, A.keep_ms)
    redis.call('HINCRBY', K.stats, 'revoked', 1)
    event(K.events, 'LeaseRevoked', 'lease', id, 'batch', f['batch'] or '', 'attempt', fmt(attempt),
          'worker', h[2] or '', 'version', h[1], 'latest', fmt(latest))
    if f['batch'] then
      local nxt = requeue(K.work, K.deadletter, K.stats, K.events, id, f['batch'], attempt,
                          tonumber(f['failures'] or '0') + 1, tonumber(A.max_attempts), h[2] or '',
                          'revoked: adapter version too stale', now)
      if nxt == 0 then dead = dead + 1 end
    else
      redis.call('XACK', K.work, WORK_GROUP, id)
    end
    revoked = revoked + 1
  end
end
local nxt = ''
if #p >= count then nxt = '(' .. p[#p][1] end
return {'ok', nxt, revoked, dead}
