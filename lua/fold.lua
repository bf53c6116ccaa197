-- fold: add the next parts of the gradients being folded ('f<k> <n> <blob>' entries of the
-- pending round, see apply.lua) into the round's running sum (its first entry,
-- 's<w> <n> <sum blob>'), at most ARGV[3] parts per call, with the accsum module. Each call is
-- atomic: an entry records how far its fold got, so a client that dies between calls leaves a
-- round the taker reads as it is (the sum plus the parts not folded yet), and a retried call
-- folds nothing twice. The last call of an entry removes it and counts the gradient in the
-- sum's weight.
--
-- Folds go in apply order: a call folds the round's FIRST 'f' entry, whoever's it is, and the
-- caller calls again until its own entry is folded in (so it also finishes the fold of a
-- worker that died before its own). Every part of the sum then holds, for the gradients
-- after it in the list, those of a prefix of them, and the taker, which adds the parts not
-- folded yet in list order, gets the sum in apply order bit for bit (a later gradient's fold
-- overtaking an earlier one's would not: floats do not associate).
-- KEYS[1] state  KEYS[2] grads list
-- ARGV[1] schema  ARGV[2] blob key of the caller's gradient  ARGV[3] parts to fold at most
-- Returns the number of parts the caller's gradient still holds apart (0: folded in, or
-- nothing to do here: the round was taken, reset or given back meanwhile, the sum cannot take
-- it, or a gradient before it cannot be folded: the taker reads them as they are).
local state, grads, blob = KEYS[1], KEYS[2], ARGV[2]
local base, kerr = own_keys({':g'})
if not base then return kerr end
if not is_own(base, blob, 'b') or not is_count(ARGV[3]) or tonumber(ARGV[3]) < 1 then
  return acc_error('BADARG fold')
end
local err, st = read_state(state, ARGV[1], {'sum', 'bytes', 'ttl'})
if err then return err end
err = check_acl({'LRANGE', grads, 'LSET', grads, 'LREM', grads, 'UNLINK', blob,
  'HSET', state, 'STRLEN', blob})
if err then return err end
if not st.sum then return 0 end
local probe = redis.pcall('ACC.PING')
if type(probe) == 'table' and probe.err then return 0 end  -- no module: the taker reads it
err = check_acl({'ACC.ADD', blob})
if err then return err end

local entries = redis.call('LRANGE', grads, '0', '-1')
local at, mine  -- the first 'f' entry (folded now) and the caller's (found after it)
for i, entry in ipairs(entries) do
  if i > 1 and string.sub(entry, 1, 1) == 'f' then
    if not at then at = i end
    if string.match(entry, '^f%d+ %d+ (.+)$') == blob then mine = i break end
  end
end
if not mine then return 0 end
local sum = entries[1]
local k, n, fblob = string.match(entries[at], '^f(%d+) (%d+) (.+)$')
k, n = tonumber(k), tonumber(n)
local skeys = string.sub(sum, 1, 1) == 's' and entry_keys(base, sum)
local own = entry_keys(base, entries[at])
if not skeys or #skeys ~= n or not own then return 0 end  -- (own: nil for a foreign blob)
if at ~= mine then
  err = check_acl({'ACC.ADD', fblob, 'UNLINK', fblob, 'STRLEN', fblob})
  if err then return err end
end
-- the caller's parts left after this call (when it folds another's entry, all of them)
local function left(folded)
  if at == mine then return n - k - folded end
  local mk, mn = string.match(entries[mine], '^f(%d+) (%d+) ')
  return tonumber(mn) - tonumber(mk)
end

-- every part to add must be whole and of the sum's part's length: checked before writing;
-- one that is not stops the folds (the ones after it would overtake it): the taker
-- quarantines it, and reads the others as they are
local m = math.min(tonumber(ARGV[3]), n - k)
for j = 1, m do
  local len = redis.call('STRLEN', own[j])
  if len == 0 or len ~= redis.call('STRLEN', skeys[k + j]) then return 0 end
end
add_parts(skeys, k, own, m, st.sum)
if k + m < n then
  redis.call('LSET', grads, at - 1, 'f' .. int_str(k + m) .. ' ' .. int_str(n) .. ' ' .. fblob)
  return left(m)
end
-- folded in: the sum holds one more gradient, the round no longer holds this one apart
local nbytes = (n - 1) * CHUNK + redis.call('STRLEN', skeys[n])
redis.call('LSET', grads, at - 1, '\0folded')
redis.call('LREM', grads, '1', '\0folded')
count_in_sum(grads, sum)
redis.call('HSET', state, 'bytes', int_str(math.max(0, tonumber(st.bytes) - nbytes)))
return left(m)
