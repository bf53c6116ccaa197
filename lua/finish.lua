-- finish: a taker has read and reduced its claimed round: free the claim, its payload keys
-- and its lease (after this nobody can take the round over).
-- KEYS[1] state  KEYS[2] claim list of this taker  KEYS[3] claim registry hash
-- KEYS[4] finished-takes zset  KEYS[5] orphans zset  KEYS[6..] the payload keys the claim
-- named in this slot
-- ARGV[1] taker id  ARGV[2] '0' when the accumulator never spreads payloads (key schema 2):
--         the claim's entries are then not looked at (a round of inline payloads would be
--         read into Lua for nothing); '1' or absent (older clients): looked at
-- Returns 1 if the round was this taker's to keep (also on a retry: the finished-takes zset
-- remembers a finish for two minutes), 0 if its lease had run out and another taker
-- took it over: the caller must not use the round then. A round with spread payloads (their
-- parts in other slots): {1, {garbage...}}, the orphans members the caller is to delete (see
-- orphans.lua), leased to it.
--
-- The finished takes are a zset scored by finish time, pruned here by score, so that the
-- registry (scanned by every take for leases that ran out) holds live claims only: its size
-- is the number of claims in flight, not the number of takes in the last two minutes.
local base, kerr = own_keys({'', ':cl', ':cd', ':o'})
if not base then return kerr end
local claim, me, done = KEYS[2], ARGV[1], KEYS[4]
if claim ~= base .. ':c:' .. me or not is_own(base, claim, 'c')
    or not (ARGV[2] == nil or ARGV[2] == '0' or ARGV[2] == '1') then
  return acc_error('BADARG finish')
end
for i = 6, #KEYS do
  if not (is_own(base, KEYS[i], 'b') or is_own(base, KEYS[i], 'p')) then return acc_error('BADKEY ' .. i) end
end
local err = check_acl({'HDEL', KEYS[3], 'ZADD', done, 'ZREMRANGEBYSCORE', done,
  'PEXPIRE', done, 'UNLINK', claim, 'UNLINK', base .. ':b:0:0', 'LRANGE', claim,
  'ZADD', KEYS[5]})
if err then return err end
err = check_types({KEYS[3], 'hash', done, 'zset', claim, 'list', KEYS[5], 'zset'})
if err then return err end
local mark = redis.call('HGET', KEYS[3], me)
if not mark then
  -- a retried finish (its first reply was lost), or a lease that ran out and was taken over
  return redis.call('ZSCORE', done, me) and 1 or 0
end
if string.find(mark, '^done ') then return 1 end  -- written by clients before the zset
-- The payload keys it unlinks are those its claim's entries name: each payload's entry is
-- looked up in the claim (LPOS: a round of inline payloads, a sparse one's, is not read into
-- Lua for it), its parts counted from the keys given for it.
local keys, named = {claim}, {}
for i = 6, #KEYS do
  local key, blob, whole = KEYS[i], KEYS[i], true
  if is_own(base, key, 'p') then blob, whole = string.match(key, '^(.*):%d+$'), false end
  local seen = named[blob] or {n = 0, whole = whole}
  seen.n = seen.n + 1
  named[blob] = seen
  keys[#keys + 1] = key
end
for blob, seen in pairs(named) do
  local entry = seen.whole and 'k' .. blob or 'p' .. seen.n .. ' ' .. blob
  if list_names(claim, entry, blob) ~= true then
    return acc_error('BADKEY ' .. blob .. ': not a payload of its claim')
  end
end
local now = now_ms()
redis.call('HDEL', KEYS[3], me)
redis.call('ZADD', done, now, me)
redis.call('ZREMRANGEBYSCORE', done, '-inf', '(' .. int_str(now - FINISH_MEMORY_MS))
redis.call('PEXPIRE', done, FINISH_MEMORY_MS)
local garbage = {}
if ARGV[2] ~= '0' then
  garbage = discard_spread(base, KEYS[5], redis.call('LRANGE', claim, '1', '-1'), now + SWEEP_LEASE_MS)
end
unlink_all(keys)
if #garbage > 0 then return {1, garbage} end
return 1
