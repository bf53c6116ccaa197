-- leave: a taker gives up (timeout, Ctrl-C, an error while reading or reducing). It leaves no
-- trace in the FIFO (if it was the head, the queued takers are woken to re-check), and a round
-- it had claimed goes back: the step, the count and the gradients are as before its take.
-- KEYS[1] state  KEYS[2] takers zset  KEYS[3] taker info hash  KEYS[4] head wake list
-- KEYS[5] queue wake channel (pub/sub)  KEYS[6] claim list of this taker  KEYS[7] grads list
-- KEYS[8] claim registry hash
-- ARGV[1] taker id  ARGV[2] schema
-- Returns 0 (it held no claim), 1 (its claim was given back) or -1: it holds a claim that
-- cannot go back because the accumulator moved on since (a reset, set_step or another take,
-- or new gradients of another round shape); that claim is kept, with an expired lease, so the
-- next take hands it over as it is (see take.lua).
local takers, me, claim, grads = KEYS[2], ARGV[1], KEYS[6], KEYS[7]
local base, kerr = own_keys({':t', ':ti', ':w', ':q', '', ':g', ':cl'})
if not base then return kerr end
if claim ~= base .. ':c:' .. me or not is_own(base, claim, 'c')
    or not (ARGV[2] == '2' or ARGV[2] == '3') or #ARGV ~= 2 then
  return acc_error('BADARG leave')
end
local state = KEYS[1]
local some_blob = base .. ':b:0:0'
local err = check_acl({'ZREM', takers, 'HDEL', KEYS[3], 'DEL', KEYS[4],
  'PUBLISH', KEYS[5], 'LPOP', claim, 'RPUSH', claim, 'RENAME', claim,
  'PERSIST', claim, 'PERSIST', grads, 'PEXPIRE', grads, 'PERSIST', some_blob,
  'PEXPIRE', some_blob, 'HSET', state, 'HINCRBY', state, 'RPUSH', KEYS[4],
  'LTRIM', KEYS[4], 'HDEL', KEYS[8], 'HSET', KEYS[8]})
if err then return err end
err = check_types({takers, 'zset', KEYS[3], 'hash', KEYS[4], 'list', claim, 'list',
  grads, 'list', KEYS[8], 'hash'})
if err then return err end

local head = redis.call('ZRANGE', takers, '0', '0')[1]
redis.call('ZREM', takers, me)
redis.call('HDEL', KEYS[3], me)
if head == me then
  redis.call('DEL', KEYS[4])
  wake_queue(KEYS[5])
end

redis.call('HDEL', KEYS[8], me)  -- no longer leased: given back below, or kept for inspection
local entries = redis.call('LRANGE', claim, '0', '-1')
if #entries == 0 then return 0 end
local function keep()
  -- handed to the next taker at the head of the FIFO as it is (its step was advanced)
  redis.call('PERSIST', claim)
  redis.call('HSET', KEYS[8], me, int_str(now_ms()))
  return -1
end
local serr, st = read_state(state, ARGV[2], {'step', 'count', 'rshape', 'gen', 'bytes', 'ttl',
  'n_taken', 'grads_taken'})
if serr then return keep() end
local hstep, hcount, hbytes, hgen, flag, rshape =
  string.match(entries[1], '^(%-?%d+) (%d+) (%d+) (%d+) ([01]) ([%d,]*)$')
if not hstep or hstep ~= st.step or hgen ~= st.gen then return keep() end
local count = tonumber(st.count)
if flag == '1' and count > 0 and st.rshape and st.rshape ~= rshape then return keep() end

-- The claimed entries go back in front of any gradients applied since (at the new step:
-- future steps for the restored one, accepted as TF accepts them).
local since = redis.call('LRANGE', grads, '0', '-1')
redis.call('LPOP', claim)
for _, entry in ipairs(since) do redis.call('RPUSH', claim, entry) end
redis.call('RENAME', claim, grads)
local ttl, ttl_text = touch(state, {grads}, st.ttl)
if ttl == 0 then redis.call('PERSIST', grads) end
for i = 2, #entries do
  for _, key in ipairs(entry_keys(base, entries[i]) or {}) do
    -- a reading take may have set a short expiry on it (freed by the next take)
    if ttl > 0 then redis.call('PEXPIRE', key, ttl_text) else redis.call('PERSIST', key) end
  end
end
count = count + tonumber(hcount)
redis.call('HINCRBY', state, 'step', '-1')
redis.call('HSET', state, 'count', int_str(count),
  'bytes', int_str(tonumber(st.bytes) + tonumber(hbytes)),
  'gen', int_str(tonumber(hgen) - 1), 'n_taken', int_str(tonumber(st.n_taken) - 1),
  'grads_taken', int_str(tonumber(st.grads_taken) - tonumber(hcount)))
if flag == '1' then redis.call('HSET', state, 'rshape', rshape) end
-- the time of the last take was this one's: with no take left, there was none
if tonumber(st.n_taken) == 1 then redis.call('HDEL', state, 'last_take_ms', 'last_take_wait_ms') end
wake_head(state, takers, KEYS[3], KEYS[4], count)
return 1
