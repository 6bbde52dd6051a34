-- Helpers every script shares; the loader prepends this file (after the constants it generates
-- from Python: WORK_GROUP, LEARNER_GROUP, EVENTS_MAXLEN, BATCH_ID_FORMAT, and the K / A tables).
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function tomap(f)
  local m = {}
  if f then for i = 1, #f, 2 do m[f[i]] = f[i + 1] end end
  return m
end
local function fmt(n) return string.format('%d', n) end
local function event(key, typ, ...)
  redis.call('XADD', key, 'MAXLEN', '~', EVENTS_MAXLEN, '*', 'type', typ, ...)
end
local function refuse(kind, message) return {'err', kind, message} end
-- Finished epochs are compacted (compact.lua): once every batch of an epoch had its fate, its ids
-- leave `completed`, `consumed` and `rejected`, and stats.epochs_done says every batch of an epoch
-- below it is done. So "was it completed?" is the set, or an epoch below that mark.
local function epoch_of(batch)
  return tonumber(string.match(batch, ':(%d+):%d+$') or '-1')
end
local function compacted(stats, batch)
  local e = epoch_of(batch)
  return e >= 0 and e < tonumber(redis.call('HGET', stats, 'epochs_done') or '0')
end
-- take a work entry back (XACK + XDEL) and requeue it as attempt+1, or dead-letter it once
-- `failures` reached max_attempts. Returns the next attempt, or 0 when dead-lettered.
local function requeue(work, deadletter, stats, events, id, batch, attempt, failures, max_attempts, worker,
                       reason, now)
  redis.call('XACK', work, WORK_GROUP, id)
  redis.call('XDEL', work, id)
  if failures >= max_attempts then
    -- the newest DEADLETTER_KEPT are kept (ListDeadLetters); stats.deadlettered counts them all
    redis.call('XADD', deadletter, 'MAXLEN', '~', DEADLETTER_KEPT, '*', 'batch', batch, 'reason', reason,
               'last_worker', worker, 'attempts', fmt(attempt), 'time', fmt(now))
    redis.call('HINCRBY', stats, 'deadlettered', 1)
    event(events, 'BatchDeadLettered', 'batch', batch, 'attempts', fmt(attempt), 'reason', reason, 'worker', worker)
    return 0
  end
  redis.call('XADD', work, '*', 'batch', batch, 'attempt', fmt(attempt + 1), 'failures', fmt(failures))
  return attempt + 1
end
-- a lease that ended (completed, failed, expired, revoked) leaves the janitor's two indexes
local function unindex(deadlines, versions, id)
  redis.call('ZREM', deadlines, id)
  redis.call('ZREM', versions, id)
end
-- a moving average in a stats field (integer ms): what automatic lookahead (acquire.lua) reads.
-- The newest sample weighs a quarter: a few steps follow a change of machine or load, and one slow
-- batch does not swing the choice.
local function average_ms(stats, field, sample)
  local old = tonumber(redis.call('HGET', stats, field) or '0')
  local new = sample
  if old > 0 then new = old + (sample - old) / 4 end
  redis.call('HSET', stats, field, fmt(math.floor(new + 0.5)))
end
local function pending_for(work, id, worker)
  local p = redis.call('XPENDING', work, WORK_GROUP, id, id, 1, worker)
  return #p > 0
end
