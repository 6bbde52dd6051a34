-- Requeue (or dead-letter) up to `count` leases idle for `min_idle_ms`, taking them over with
-- XAUTOCLAIM under the consumer name 'janitor'.
-- KEYS: work deadletter stats events
-- ARGV: min_idle_ms cursor count max_attempts lease_prefix keep_ms
-- FLAGS: allow-oom
-- Reply: {'ok', next cursor ('' = done), expired, dead-lettered}
local start = A.cursor
if start == '' then start = '0-0' end
local res = redis.call('XAUTOCLAIM', K.work, WORK_GROUP, 'janitor', A.min_idle_ms, start, 'COUNT', A.count)
local now = now_ms()
local expired, dead = 0, 0
for _, e in ipairs(res[2]) do
  local id = e[1]
  if not e[2] then
    redis.call('XACK', K.work, WORK_GROUP, id)   -- Redis < 7: entry deleted but still pending
  else
    local f = tomap(e[2])
    local lk = A.lease_prefix .. id
    local worker = redis.call('HGET', lk, 'worker') or ''
    if worker ~= '' then
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
local nxt = res[1]
if nxt == '0-0' then nxt = '' end
return {'ok', nxt, expired, dead}
