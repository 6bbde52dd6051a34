-- Compact finished epochs: the ids of every batch of an epoch whose batches all had their fate
-- leave `completed`, `consumed` and `rejected`, `slice` at a time, so the memory of a run grows with
-- its current epoch, not with every batch it ever cut. stats.epochs_done = D says every epoch below D
-- is done (common.lua's `compacted`); stats.compact_next is how far the ids of epoch D - 1 are gone;
-- stats.consumed_compacted counts the consumed ids removed (RunState.consumed adds it back).
-- `epoch` = the epoch the caller found with nothing in flight (no work or rollouts entry), after
-- reading that it was cut whole; -1 = only go on removing.
-- KEYS: completed consumed rejected stats cursor
-- ARGV: run batches_per_epoch epoch slice
-- FLAGS: allow-oom
-- Reply: {'ok', 'more' | '' (done), ids removed}
local bpe = tonumber(A.batches_per_epoch)
local done = tonumber(redis.call('HGET', K.stats, 'epochs_done') or '0')
local nxt = tonumber(redis.call('HGET', K.stats, 'compact_next') or A.batches_per_epoch)
if done > 0 and nxt < bpe then
  local stop = math.min(bpe, nxt + tonumber(A.slice))
  local ids = {}
  for i = nxt, stop - 1 do ids[#ids + 1] = string.format(BATCH_ID_FORMAT, A.run, done - 1, i) end
  redis.call('SREM', K.completed, unpack(ids))
  redis.call('HINCRBY', K.stats, 'consumed_compacted', redis.call('SREM', K.consumed, unpack(ids)))
  redis.call('HDEL', K.rejected, unpack(ids))
  redis.call('HSET', K.stats, 'compact_next', fmt(stop))
  return {'ok', stop < bpe and 'more' or '', stop - nxt}
end
local e = tonumber(A.epoch)
if e == done and tonumber(redis.call('GET', K.cursor) or '0') >= (e + 1) * bpe then
  redis.call('HSET', K.stats, 'epochs_done', fmt(e + 1), 'compact_next', '0')
  return {'ok', 'more', 0}
end
return {'ok', '', 0}
