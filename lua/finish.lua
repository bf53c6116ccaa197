-- finish: a taker has read and reduced its claimed round: free the claim, its payload keys
-- and its lease (after this nobody can take the round over).
-- KEYS[1] state  KEYS[2] claim list of this taker  KEYS[3] claim registry hash
-- KEYS[4..] the payload keys the claim named
-- ARGV[1] taker id
-- Returns 1 if the round was this taker's to keep (also on a retry: the registry keeps a
-- 'done <ms>' mark for two minutes), 0 if its lease had run out and another taker
-- took it over: the caller must not use the round then.
local base, kerr = own_keys({'', ':cl'})
if not base then return kerr end
local claim, me = KEYS[2], ARGV[1]
if claim ~= base .. ':c:' .. me or not is_own(base, claim, 'c') then return acc_error('BADARG finish') end
for i = 4, #KEYS do
  if not (is_own(base, KEYS[i], 'b') or is_own(base, KEYS[i], 'p')) then return acc_error('BADKEY ' .. i) end
end
local err = check_acl({{'HSET', KEYS[3]}, {'UNLINK', claim}, {'UNLINK', base .. ':b:0:0'}})
if err then return err end
local mark = redis.call('HGET', KEYS[3], me)
if not mark then return 0 end
if not string.find(mark, '^done ') then
  redis.call('HSET', KEYS[3], me, 'done ' .. int_str(now_ms()))
  local keys = {claim}
  for i = 4, #KEYS do keys[#keys + 1] = KEYS[i] end
  unlink_all(keys)
end
return 1
