-- purge: the second step of deleting an accumulator (accumulator/_admin_ops.py, delete): unlink
-- keys found under its name after its state was deleted, unless it exists again. An open of
-- the name in between (a worker starting) creates it again, and the keys found may then be the
-- new accumulator's: nothing is unlinked, and what is left of the old one expires on its own.
-- KEYS[1] state  KEYS[2 ..] keys under '<base>:' (its own slot)
-- Returns how many of them existed and were unlinked, or -1 (it exists again: none).
local state = KEYS[1]
local base = state_base(state)
if not base then return acc_error('BADKEY 1') end
local head = base .. ':'
for i = 2, #KEYS do
  if string.sub(KEYS[i], 1, #head) ~= head then
    return acc_error('BADKEY ' .. i)
  end
end
local err = check_acl({'EXISTS', state, 'UNLINK', state})
if err then return err end
if redis.call('EXISTS', state) == 1 then return -1 end
if #KEYS < 2 then return 0 end
return redis.call('UNLINK', unpack(KEYS, 2))
