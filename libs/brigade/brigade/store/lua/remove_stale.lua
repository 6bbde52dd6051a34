-- Drop up to `count` completed manifests too stale to train on. Only manifests the learner has
-- not been handed yet (after the group's last-delivered id) are removed: one the learner holds is
-- its to consume or reject, so a batch never ends both.
-- KEYS: rollouts adapter_latest rejected stats events
-- ARGV: max_staleness cursor count
-- FLAGS: allow-oom
-- Reply: {'ok', next cursor ('' = done; the first call passes '' = after the last delivered entry), removed}
local latest = tonumber(redis.call('GET', K.adapter_latest) or '0')
local ms = tonumber(A.max_staleness)
if latest <= ms then return {'ok', '', 0} end
local start = A.cursor
if start == '' then
  local last = '0-0'
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', K.rollouts)) do
    local m = tomap(g)
    if m['name'] == LEARNER_GROUP then last = m['last-delivered-id'] end
  end
  start = '(' .. last
  if last == '0-0' then start = '-' end
end
local count = tonumber(A.count)
local entries = redis.call('XRANGE', K.rollouts, start, '+', 'COUNT', count)
local removed = 0
for _, e in ipairs(entries) do
  local f = tomap(e[2])
  local v = tonumber(f['version'] or '0')
  if latest - v > ms then
    redis.call('XDEL', K.rollouts, e[1])
    redis.call('HSETNX', K.rejected, f['batch'], 'stale (janitor)')
    redis.call('HINCRBY', K.stats, 'stale_removed', 1)
    event(K.events, 'RolloutRejected', 'batch', f['batch'], 'version', f['version'] or '0', 'latest', fmt(latest),
          'reason', 'stale (janitor)')
    removed = removed + 1
  end
end
local nxt = ''
if #entries >= count then nxt = '(' .. entries[#entries][1] end
return {'ok', nxt, removed}
