-- fold: add the next parts of a gradient being folded ('f<k> <n> <blob>' entry of the pending
-- round, see apply.lua) into the round's running sum (its first entry, 's<w> <n> <sum blob>'),
-- at most ARGV[3] parts per call, with the accsum module. Each call is atomic: the entry
-- records how far the fold got, so a client that dies between calls leaves a round the taker
-- reads as it is (the sum plus the parts not folded yet), and a retried call folds nothing
-- twice. The last call removes the entry and counts the gradient in the sum's weight.
-- KEYS[1] state  KEYS[2] grads list
-- ARGV[1] schema  ARGV[2] blob key of the gradient  ARGV[3] parts to fold at most
-- Returns the number of parts the gradient still holds apart (0: folded in, or nothing to
-- do here: the round was taken, reset or given back meanwhile, or the sum cannot take it).
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
local at, k, n
for i, entry in ipairs(entries) do
  local ek, en, eblob = string.match(entry, '^f(%d+) (%d+) (.+)$')
  if eblob == blob then at, k, n = i, tonumber(ek), tonumber(en) break end
end
if not at or at == 1 then return 0 end
local sum = entries[1]
local skeys = string.sub(sum, 1, 1) == 's' and entry_keys(base, sum)
local own = entry_keys(base, entries[at])
if not skeys or #skeys ~= n or not own then return 0 end

-- every part to add must be whole and of the sum's part's length: checked before writing
local m = math.min(tonumber(ARGV[3]), n - k)
for j = 1, m do
  local len = redis.call('STRLEN', own[j])
  if len == 0 or len ~= redis.call('STRLEN', skeys[k + j]) then return n - k end
end
add_parts(skeys, k, own, m, st.sum)
if k + m < n then
  redis.call('LSET', grads, at - 1, 'f' .. int_str(k + m) .. ' ' .. int_str(n) .. ' ' .. blob)
  return n - k - m
end
-- folded in: the sum holds one more gradient, the round no longer holds this one apart
local nbytes = (n - 1) * CHUNK + redis.call('STRLEN', skeys[n])
redis.call('LSET', grads, at - 1, '\0folded')
redis.call('LREM', grads, '1', '\0folded')
count_in_sum(grads, sum)
redis.call('HSET', state, 'bytes', int_str(math.max(0, tonumber(st.bytes) - nbytes)))
return 0
