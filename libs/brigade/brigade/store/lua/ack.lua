-- The learner's checkpoint covers these: ack the deliveries, record consumed / rejected batches,
-- move the learner step forward, keep the step's metrics.
-- KEYS: rollouts consumed rejected learner_step metrics stats events completed work cursor
-- ARGV: step metrics_json n_deliveries n_consumed learner batches_per_step max_advance max_steps metrics_maxlen
-- ARGV: run batches_per_epoch total_batches lost_cuts ids...
-- FLAGS: allow-oom
-- Reply: {'ok', acked, consumed, rejected} | {'err', kind, message}
-- ids: n_deliveries delivery ids, then n_consumed consumed batch ids, then the rejected batch ids.
-- A step is at most one commit ahead of the stored step (`max_advance` = checkpoint_every), or what
-- the consumed batches make (batches_per_step each), and never past max_steps: a forged step far
-- ahead (2^64 - 1) would otherwise finish the run for good. The first bound lets a learner repair a
-- Redis that lost the completions of batches it trained (acked one commit at a time); the second,
-- a Redis that lost many step acks but kept the batches. Checked before anything changes.
-- A batch of a compacted epoch (common.lua) already has its fate: acking it again changes nothing.
-- A consumed batch Redis does not know as completed, but holds as outstanding work (queued again, or
-- leased again), is one whose completion a Redis crash lost after the learner trained on it: the
-- learner's checkpoint is the record. It is completed and consumed now, and its work entries are taken
-- back, so it is neither generated again nor, once its attempts run out, dead-lettered though trained.
-- One Redis holds nowhere, at or past its cursor, is one whose cut the crash lost too (the learner only
-- sees batches that were cut, in cursor order): it is completed and consumed now, and acquire.lua passes
-- over it when the cursor gets there. `lost_cuts` bounds how far past the cursor that can be, so no ack
-- marks more than that many batches ahead. One below the cursor, and not outstanding, had another fate
-- (dead-lettered) or is forged: refused.
local cursor  -- read only when an ack names a batch Redis does not know (after a crash)
local function lost_cut(batch)
  local run, epoch, index = string.match(batch, '^(.+):(%d+):(%d+)$')
  if run ~= A.run or tonumber(index) >= tonumber(A.batches_per_epoch) then return false end
  cursor = cursor or tonumber(redis.call('GET', K.cursor) or '0')
  local n = tonumber(epoch) * tonumber(A.batches_per_epoch) + tonumber(index)
  local total = tonumber(A.total_batches)
  return n >= cursor and n < cursor + tonumber(A.lost_cuts) and (total == 0 or n < total)
end
local ids = A.ids
local nd, nc = tonumber(A.n_deliveries), tonumber(A.n_consumed)
local old, outstanding, recovered = {}, nil, {}
for i = nd + 1, #ids do
  if compacted(K.stats, ids[i]) then
    old[ids[i]] = true
  elseif redis.call('SISMEMBER', K.completed, ids[i]) == 0 then
    if outstanding == nil then  -- the work stream holds at most the admission capacity: read it once
      outstanding = {}
      for _, e in ipairs(redis.call('XRANGE', K.work, '-', '+')) do
        local b = tomap(e[2])['batch']
        if b then
          outstanding[b] = outstanding[b] or {}
          table.insert(outstanding[b], e[1])
        end
      end
    end
    if i <= nd + nc and outstanding[ids[i]] then
      recovered[ids[i]] = outstanding[ids[i]]
    elseif i <= nd + nc and lost_cut(ids[i]) then
      recovered[ids[i]] = {}
    else
      return refuse('invalid', 'batch ' .. ids[i] .. ' was never completed in this run')
    end
  end
end
local step = tonumber(A.step)
local new = {}
for i = nd + 1, nd + nc do
  if not old[ids[i]] and redis.call('SISMEMBER', K.consumed, ids[i]) == 0
     and redis.call('HEXISTS', K.rejected, ids[i]) == 0 then
    new[ids[i]] = true
  end
end
local will_consume = redis.call('SCARD', K.consumed) + tonumber(redis.call('HGET', K.stats, 'consumed_compacted') or '0')
for _ in pairs(new) do will_consume = will_consume + 1 end
local reachable = math.max(math.floor(will_consume / tonumber(A.batches_per_step)),
                           tonumber(redis.call('GET', K.learner_step) or '0') + tonumber(A.max_advance))
local max_steps = tonumber(A.max_steps)
if max_steps > 0 and reachable > max_steps then reachable = max_steps end
if step > reachable then
  return refuse('invalid', 'step ' .. A.step .. ' is beyond what the run can have reached (' .. fmt(reachable) ..
                ': one commit past the stored step, or what ' .. fmt(will_consume) .. ' consumed batches make)')
end
for batch, entries in pairs(recovered) do
  for _, id in ipairs(entries) do
    redis.call('XACK', K.work, WORK_GROUP, id)
    redis.call('XDEL', K.work, id)
  end
  redis.call('SADD', K.completed, batch)
  event(K.events, 'BatchRecovered', 'batch', batch, 'lost', #entries > 0 and 'completion' or 'cut',
        'learner', A.learner)
end
local acked = 0
for i = 1, nd do
  acked = acked + redis.call('XACK', K.rollouts, LEARNER_GROUP, ids[i])
  redis.call('XDEL', K.rollouts, ids[i])
end
local consumed, rejected = 0, 0
for i = nd + 1, nd + nc do
  if new[ids[i]] then
    consumed = consumed + redis.call('SADD', K.consumed, ids[i])
  end
end
for i = nd + nc + 1, #ids do
  if not old[ids[i]] and redis.call('SISMEMBER', K.consumed, ids[i]) == 0
     and redis.call('HSETNX', K.rejected, ids[i], 'learner') == 1 then
    rejected = rejected + 1
    redis.call('HINCRBY', K.stats, 'rejected', 1)
  end
end
local old = tonumber(redis.call('GET', K.learner_step) or '-1')
if step > old then
  redis.call('SET', K.learner_step, A.step)
  -- step 0 acks only carry rejections made before the first step; no step completed
  if step > 0 then
    event(K.events, 'StepCompleted', 'step', A.step, 'consumed', fmt(nc), 'rejected', fmt(#ids - nd - nc),
          'learner', A.learner)
  end
end
if A.metrics_json ~= '' and step > tonumber(redis.call('HGET', K.stats, 'metrics_step') or '-1') then
  redis.call('HSET', K.stats, 'metrics_step', A.step)
  redis.call('XADD', K.metrics, 'MAXLEN', '~', A.metrics_maxlen, '*', 'step', A.step, 'json', A.metrics_json)
end
return {'ok', acked, consumed, rejected}
