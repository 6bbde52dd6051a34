-- A worker's lease cycle in one call (CompleteLease with `next`): complete its lease, then grant
-- its next one. The grant runs only once the completion is accepted (completed, or a duplicate);
-- a refused completion refuses the whole call and grants nothing, as two separate calls did.
-- PARTS: complete acquire
-- Reply: {'ok', complete's reply, acquire's reply} | complete's refusal {'err', kind, message}
local done = complete()
if done[1] ~= 'ok' then return done end
return {'ok', done, acquire()}
