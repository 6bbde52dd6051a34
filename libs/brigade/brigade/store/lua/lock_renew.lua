-- Extend the janitor lock, only if `owner` still holds it.
-- KEYS: lock
-- ARGV: owner ttl_ms
-- FLAGS: allow-oom
-- Reply: {'ok', 1 renewed | 0 not ours}
if redis.call('GET', K.lock) == A.owner then
  redis.call('PEXPIRE', K.lock, A.ttl_ms)
  return {'ok', 1}
end
return {'ok', 0}
