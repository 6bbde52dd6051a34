-- Delete the janitor lock, only if `owner` still holds it.
-- KEYS: lock
-- ARGV: owner
-- FLAGS: allow-oom
-- Reply: {'ok', 1 released | 0 not ours}
if redis.call('GET', K.lock) == A.owner then return {'ok', redis.call('DEL', K.lock)} end
return {'ok', 0}
