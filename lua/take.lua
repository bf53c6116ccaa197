-- take: join the FIFO of takers (or renew this taker's lease) and, when this taker is at the
-- head and the round holds num_required valid gradients, claim the round atomically.
-- KEYS[1] state  KEYS[2] grads list  KEYS[3] takers zset  KEYS[4] taker info hash
-- KEYS[5] claim list of this taker  KEYS[6] head wake list  KEYS[7] queue wake channel (pub/sub)
-- KEYS[8] quarantine list  KEYS[9] claim registry hash (taker id -> claim lease expiry ms of
-- each claim in flight)  KEYS[10] orphans zset (spread payloads)
-- ARGV[1] schema  ARGV[2] taker id  ARGV[3] num_required  ARGV[4] lease ms
-- ARGV[5] 'd' dense | 's' sparse  ARGV[6] bytes per element of the accumulator dtype
-- ARGV[7] claim lease ms  ARGV[8] claim lease: extra ms per MiB of payload
-- ARGV[9] the instance id the client's object opened (always sent; '': unchecked; see check_inst)
-- ARGV[10] m, then m pairs ARGV[11..]: a spread entry the client checked (the reply {2, ...}
--         below) and its payload length, or why it is unusable ('missing', 'part 3 length 5')
-- Returns {1, claim, quarantined, adopted, payloads} where claim = {header, entry...}, header =
-- "<new step> <count> <payload bytes> <gen> <0|1> <round shape>" (1 when a round shape is
-- recorded) and adopted = 1 when the claim is one a taker that is gone left behind (its step
-- was advanced then; the round is handed over as it was) and payloads those of its entries
-- when they are small (see with_payloads; absent otherwise); or {0, is_head, quarantined} when
-- it must wait; or {2, entries} when it would claim but the round holds spread entries the
-- client has not checked (their parts are in other slots): the client checks those parts
-- (STRLEN) and calls again with the lengths, so that a claim never holds a missing part.
--
-- Every claim is registered with a lease until its taker has read and
-- reduced it (finish.lua) or given it back (leave.lua). A claim whose lease ran out belongs to
-- a taker that is gone: the next taker at the head of the FIFO that requires no more gradients
-- than it holds takes it over before anything else, so no accepted gradient is lost with a
-- crashed chief.
--
-- Before the claim every entry is checked: an inline payload or an existing payload key of
-- this accumulator, of the length the round shape and dtype give. Anything else (a foreign key
-- name, a missing, evicted or resized payload) is moved to the quarantine list, with the
-- reason, and not counted: the take never claims what it cannot read.
local state, grads, takers, info_key, claim = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local base, kerr = own_keys({':g', ':t', ':ti', '', ':w', ':q', ':x', ':cl', ':o'})
if not base then return kerr end
local me = ARGV[2]
if claim ~= base .. ':c:' .. me or not is_own(base, claim, 'c') or not is_count(ARGV[3])
    or tonumber(ARGV[3]) < 1 or not is_count(ARGV[4])
    or not (ARGV[5] == 'd' or ARGV[5] == 's') or not is_count(ARGV[6])
    or not is_count(ARGV[7]) or not is_count(ARGV[8]) or not is_inst(ARGV[9])
    or not is_count(ARGV[10] or '') or #ARGV ~= 10 + 2 * tonumber(ARGV[10]) then
  return acc_error('BADARG take')
end
if #KEYS ~= 10 then return acc_error('BADKEY ' .. #KEYS) end
local checked = {}  -- spread entry -> its length or why it is unusable, as the client found
for i = 11, #ARGV, 2 do checked[ARGV[i]] = ARGV[i + 1] end
local err, st = read_state(state, ARGV[1], {'step', 'count', 'rshape', 'ttl', 'n_taken',
  'grads_taken', 'gen', 'bytes'}, ARGV[9])
if err then return err end
-- What this script and the client's reading of a claim (MGET, PEXPIRE, UNLINK) will need.
local some_blob = base .. ':b:0:0'
err = check_acl({'UNLINK', claim, 'UNLINK', some_blob, 'HSET', state,
  'HINCRBY', state, 'HDEL', state, 'PEXPIRE', state, 'ZADD', takers,
  'ZREM', takers, 'HSET', info_key, 'HDEL', info_key, 'RENAME', grads,
  'LPUSH', claim, 'PEXPIRE', claim, 'PERSIST', claim, 'DEL', KEYS[6],
  'PUBLISH', KEYS[7], 'RPUSH', KEYS[8], 'LSET', grads, 'LREM', grads,
  'MGET', some_blob, 'PEXPIRE', some_blob, 'PERSIST', some_blob, 'STRLEN', some_blob,
  'HSET', KEYS[9], 'HDEL', KEYS[9], 'HGETALL', KEYS[9], 'EXISTS', claim, 'LINDEX', claim,
  'RENAME', claim, 'LRANGE', grads, 'ZCARD', takers, 'ZRANGE', takers,
  'ZSCORE', takers, 'HGET', info_key, 'HGET', state, 'TIME', false, 'ZADD', KEYS[10],
  'PEXPIRE', takers, 'PEXPIRE', info_key, 'PEXPIRE', KEYS[8], 'PEXPIRE', KEYS[9],
  -- and what the taker's wait, its finish (finish.lua) and its giving back (leave.lua) need:
  -- a take that could claim but not finish, or wait but not leave, is refused before it starts
  'BLPOP', KEYS[6], 'LPOP', claim, 'RPUSH', claim, 'LRANGE', claim, 'PERSIST', grads,
  'PEXPIRE', grads, 'RPUSH', KEYS[6], 'LTRIM', KEYS[6], 'ZADD', base .. ':cd',
  'ZREMRANGEBYSCORE', base .. ':cd', 'PEXPIRE', base .. ':cd',
  'GET', some_blob})
if err then return err end
err = check_types({grads, 'list', takers, 'zset', info_key, 'hash', claim, 'list',
  KEYS[6], 'list', KEYS[8], 'list', KEYS[9], 'hash', KEYS[10], 'zset'})
if err then return err end

-- The payloads of a claim's entries, when each is held in one key and all of them together
-- are SENT_MAX bytes at most: the taker then reads nothing more (it frees their keys with the
-- finish, as it does the others'). payloads[i] is entries[i + 1]'s (false: inline). Larger
-- ones are not worth it: bytes through Lua cost more than the read they save (measured: a
-- 4 x 40 KiB round 0.95x, 4 x 64 KiB 1.03x, one 256 KiB sum 1.5x the take with a read).
local SENT_MAX = 131072
local function with_payloads(entries, quarantined, adopted)
  local keys, total, any = {}, 0, false
  for i = 2, #entries do
    local entry = entries[i]
    if string.sub(entry, 1, 1) ~= 'i' then
      local one = entry_first_part(entry) == 0 and entry_keys(base, entry)
      if not one or #one ~= 1 then return {1, entries, quarantined, adopted} end
      -- (pcall: a payload overwritten since it was checked is the client's to find, reading)
      local len = redis.pcall('STRLEN', one[1])
      if type(len) ~= 'number' then return {1, entries, quarantined, adopted} end
      total = total + len
      if total > SENT_MAX then return {1, entries, quarantined, adopted} end
      keys[i - 1], any = one[1], true
    end
  end
  if not any then return {1, entries, quarantined, adopted} end
  local payloads = {}
  for i = 1, #entries - 1 do
    payloads[i] = keys[i] and redis.pcall('GET', keys[i]) or false
    if type(payloads[i]) == 'table' then return {1, entries, quarantined, adopted} end
  end
  return {1, entries, quarantined, adopted, payloads}
end

-- A retry of a take that already claimed (the reply was lost): hand out the same round
-- (also when that claim advanced the step to the int64 maximum, which refuses a new take).
if redis.call('EXISTS', claim) == 1 then
  return with_payloads(redis.call('LRANGE', claim, '0', '-1'), 0, 0)
end
if st.step == INT64_MAX then return acc_error('STEPMAX') end

local now = now_ms()
local n = tonumber(ARGV[3])
local count = tonumber(st.count)
local joined = now
local queued = redis.call('ZCARD', takers) > 0

if queued then
  -- A taker whose lease ran out (crashed, or stopped renewing) no longer blocks the FIFO.
  local pruned = false
  while true do
    local head = redis.call('ZRANGE', takers, '0', '0')[1]
    if not head or head == me then break end
    local info = redis.call('HGET', info_key, head)
    if info then
      local _, expiry = taker_info(info)
      if expiry > now then break end
    end
    redis.call('ZREM', takers, head)
    redis.call('HDEL', info_key, head)
    pruned = true
  end
  local info = redis.call('HGET', info_key, me)
  if info and redis.call('ZSCORE', takers, me) then
    local _, _, j = taker_info(info)
    joined = j
  end
  local head = redis.call('ZRANGE', takers, '0', '0')[1]
  if pruned and head ~= me then wake_queue(KEYS[7]) end
  queued = head ~= nil and head ~= me
end

local function claim_lease(nbytes, entries)
  return int_str(now + claim_lease_ms(ARGV[7], ARGV[8], nbytes, entries))
end

local function leave_fifo()
  if redis.call('ZREM', takers, me) == 1 then
    redis.call('HDEL', info_key, me)
    redis.call('DEL', KEYS[6])
    wake_queue(KEYS[7])
  end
end

-- At the head (or alone): first a round whose taker is gone (its claim lease ran out). The
-- registry holds the claims in flight only (finish.lua moves a finished one out).
if not queued and redis.call('EXISTS', KEYS[9]) == 1 then
  local registry = redis.call('HGETALL', KEYS[9])
  for i = 1, #registry, 2 do
    local other, mark = registry[i], registry[i + 1]
    local expiry = tonumber(mark)
    local dead = base .. ':c:' .. other
    if not expiry or not is_own(base, dead, 'c') or redis.call('EXISTS', dead) == 0 then
      -- given back meanwhile, not ours to follow, or a 'done' mark of an older client
      redis.call('HDEL', KEYS[9], other)
    elseif expiry <= now then
      -- its header, read once (LINDEX of a value of another type is an error: a pcall, not
      -- TYPE, which the roles do not grant; a missing header is false, not a table)
      local head = redis.pcall('LINDEX', dead, '0')
      if type(head) == 'table' then
        redis.call('HDEL', KEYS[9], other)  -- a value of another type: not ours to follow
      elseif tonumber(string.match(head or '', '^%-?%d+ (%d+) ') or '0') >= n then
        -- (a round of fewer gradients than this take requires waits for one that asks
        -- fewer, or a reset: num_required holds for a round taken over too)
        redis.call('HDEL', KEYS[9], other)
        redis.call('RENAME', dead, claim)
        local entries = redis.call('LRANGE', claim, '0', '-1')
        local _, _, held = string.match(entries[1], '^(%-?%d+) (%d+) (%d+) ')
        redis.call('HSET', KEYS[9], me, claim_lease(held or '0', #entries - 1))
        redis.call('HINCRBY', state, 'n_adopted', '1')
        leave_fifo()
        touch(state, {state, takers, info_key, KEYS[9]}, st.ttl)
        return with_payloads(entries, 0, 1)
      end
    end
  end
end

-- At the head (or alone) with enough gradients: check every entry before claiming.
local quarantined = 0
local nbytes = st.bytes
local validated  -- the round's entries as checked, when none had to be quarantined
if not queued and count >= n then
  local dims = 1
  for d in string.gmatch(st.rshape or '', '%d+') do dims = dims * tonumber(d) end
  local isz = tonumber(ARGV[6])
  local function fits(len, entry)
    -- a gradient being folded holds its parts from k on (the sum has the others)
    local folded = entry_first_part(entry) * CHUNK
    if ARGV[5] == 'd' then return len == dims * isz - folded end
    return folded == 0 and len % (8 + dims * isz) == 0
  end
  local entries = redis.call('LRANGE', grads, '0', '-1')
  local total, bad, held, unchecked, lens = 0, {}, 0, {}, {}
  for i, entry in ipairs(entries) do
    local keys, why = entry_keys(base, entry)
    local len
    if keys and string.sub(entry, 1, 1) == 'd' then
      local found = checked[entry]
      if not found then
        unchecked[#unchecked + 1] = entry
        why = 'unchecked'
      elseif is_count(found) then
        len = tonumber(found)
      else
        why = found
      end
    elseif keys then
      len, why = entry_length(entry, keys)
    end
    if not why and not fits(len, entry) then why = 'length ' .. len end
    if why then
      bad[#bad + 1] = {i, why, entry, keys}
    else
      total, held, lens[i] = total + len, held + entry_weight(entry), len
    end
  end
  if #unchecked > 0 then return {2, unchecked, 0} end  -- nothing claimed: check, call again
  -- a gradient being folded has its first parts in the running sum (the round's first entry)
  -- only: a lost sum takes them along (read without them, it would be counted whole and
  -- summed in part)
  if string.sub(entries[1] or '', 1, 1) == 's' and not lens[1] then
    for i, entry in ipairs(entries) do
      if string.sub(entry, 1, 1) == 'f' and lens[i] then  -- (not found bad already)
        bad[#bad + 1] = {i, 'parts 0-' .. (entry_first_part(entry) - 1) .. ' in the lost sum',
          entry, entry_keys(base, entry)}
        total, held = total - lens[i], held - 1
      end
    end
  end
  -- The entries' weight must be the count: a round list lost (evicted under an allkeys-*
  -- policy while the state stayed) or cut short would otherwise be claimed as counted, the
  -- step advanced and the mean divided by gradients that are not there (security review).
  -- What is there is what is claimed; the rest is recorded in the quarantine as lost.
  local lost = count - held
  for _, b in ipairs(bad) do lost = lost - entry_weight(b[3]) end
  if #bad == 0 and lost == 0 then validated = entries end
  if lost > 0 then
    bad[#bad + 1] = {false, 'lost', int_str(lost) .. ' counted gradient(s) not in the round'}
  end
  if #bad > 0 or held ~= count then
    for _, b in ipairs(bad) do
      if b[1] then
        discard_spread(base, KEYS[10], {b[3]}, now)  -- a sweeper deletes its parts
        redis.call('LSET', grads, b[1] - 1, '\0bad')
        -- payload keys of ours in an unusable entry are freed (a foreign key is never touched)
        if b[4] then unlink_all(b[4]) end
      end
      redis.call('RPUSH', KEYS[8], b[2] .. ' ' .. b[3])
    end
    if #bad > 0 and bad[1][1] then redis.call('LREM', grads, '0', '\0bad') end
    count = held
    nbytes = int_str(total)
    quarantined = #bad  -- (gradients: a lost one's record stands for each it names)
    if lost > 0 then quarantined = quarantined - 1 + lost end
    redis.call('HSET', state, 'count', int_str(count), 'bytes', nbytes)
    redis.call('HINCRBY', state, 'n_quarantined', int_str(quarantined))
    if count == 0 then redis.call('HDEL', state, 'rshape') end
    touch(state, {KEYS[8]}, st.ttl)
  end
end

if queued or count < n then
  -- wait: join the FIFO (or stay in it) with a renewed lease
  if not redis.call('ZSCORE', takers, me) then
    redis.call('ZADD', takers, redis.call('HINCRBY', state, 'tseq', '1'), me)
  end
  redis.call('HSET', info_key, me,
    int_str(n) .. ' ' .. int_str(now + tonumber(ARGV[4])) .. ' ' .. int_str(joined))
  local head = redis.call('ZRANGE', takers, '0', '0')[1]
  touch(state, {state, takers, info_key}, st.ttl)
  return {0, head == me and 1 or 0, quarantined}
end

-- Claim: this taker is at the head (or alone) and the round is big enough.
-- The RENAME first: at maxmemory Redis refuses a script's first write if it needs memory
-- (HINCRBY would), and a claim is how a full server is drained (its taker frees the round).
redis.call('RENAME', grads, claim)  -- count >= num_required >= 1: the list exists
-- HINCRBY keeps the step an exact int64 (Lua numbers are doubles)
local gen = int_str(tonumber(st.gen) + 1)
redis.call('HINCRBY', state, 'step', '1')
local header = redis.call('HGET', state, 'step') .. ' ' .. int_str(count) .. ' ' .. nbytes ..
  ' ' .. gen .. ' ' .. (st.rshape and ('1 ' .. st.rshape) or '0 ')
redis.call('LPUSH', claim, header)
-- the claim is the header and the entries just checked (not read again: inline payloads
-- would be made Lua strings twice); after a quarantine, what is left
local entries = {header}
if validated then
  for i = 1, #validated do entries[i + 1] = validated[i] end  -- (unpack stops at ~8000)
else
  entries = redis.call('LRANGE', claim, '0', '-1')
end
-- Kept, under a lease, until the taker has read and reduced it (finish.lua) or gives it back.
redis.call('PERSIST', claim)
redis.call('HSET', KEYS[9], me, claim_lease(nbytes, #entries - 1))

redis.call('HSET', state, 'count', '0', 'bytes', '0', 'last_take_ms', int_str(now),
  'last_take_wait_ms', int_str(now - joined), 'gen', gen,
  'n_taken', int_str(tonumber(st.n_taken) + 1),
  'grads_taken', int_str(tonumber(st.grads_taken) + count))
redis.call('HDEL', state, 'rshape')
leave_fifo()
touch(state, {state, takers, info_key, KEYS[9]}, st.ttl)
return with_payloads(entries, quarantined, 0)
