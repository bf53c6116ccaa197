-- apply: record one gradient, or drop it as stale. Bookkeeping only: a large payload was
-- written to its own key (KEYS[7]) by the same pipeline; a small one comes inline in ARGV[6].
-- KEYS[1] state  KEYS[2] grads list  KEYS[3] dedup key of this client  KEYS[4] takers zset
-- KEYS[5] taker info hash  KEYS[6] head wake list  KEYS[7] blob key (unused when inline)
-- KEYS[8] orphans zset (spread payloads: see orphans.lua)
-- ARGV[1] schema  ARGV[2] client seq  ARGV[3] local_step  ARGV[4] shape token
-- ARGV[5] 'i' inline | 'k' one blob key | 'p' parts KEYS[7]:0 .. :n-1 of CHUNK bytes each (the
--         last one shorter), n = n_parts(payload bytes) (one part up to SOLE bytes)
--         | 'd' parts spread over slots (Keys.spread_part): written by the client, which checked
--         every write's reply; registered in the orphans zset by orphans.lua before (no
--         registration, or one that ran out: refused, NOBLOB; its parts are being swept)
-- ARGV[6] 'i' .. inline payload  ARGV[7] payload bytes
-- ARGV[8] dedup ttl ms  ARGV[9] why the gradient may not open a round ('' = it may): the
--         client's check against the declared shape, which TF applies to a round's first
--         gradient only (later ones are compared with the round shape)
-- ARGV[10] the instance id the client's object opened (open.lua; absent or '': unchecked):
--         another one stored means the accumulator was deleted and created again since, and
--         the apply is refused as NOTFOUND would be (RECREATED; its payload dropped)
-- With the accsum module (state field 'sum'), a large payload is added into the round's running
-- sum in Redis instead of being kept (see below): its first FOLD parts here, the others by
-- fold.lua calls of the client (until then the entry 'f<k> <n> <blob>' holds them).
-- Returns {code, step, count, duplicate, detail}: code 1 accepted, 0 stale,
-- -1 shape differs from the round's (detail = round shape), -2 refused as a round's first
-- gradient (detail = ARGV[9]), -3 the round would exceed the accumulator's pending-bytes limit
-- (detail = the limit), -4 the accumulator is sealed (detail = the step its sync job finished
-- at; nothing written); accepted: detail = the parts left for the client to fold into the
-- round's sum (fold.lua), when there are.
-- Every input and permission is checked before the first write; a refused apply changes
-- nothing but the n_rejected statistic (and drops its own payload key).
local state, grads, dedup, blob = KEYS[1], KEYS[2], KEYS[3], KEYS[7]
local base, kerr = own_keys({':g', '', ':t', ':ti', ':w', '', ':o'})
if not base then return kerr end
if not is_own(base, dedup, 'd') or not is_own(base, blob, 'b')
    or blob ~= apply_blob(base, dedup, ARGV[2]) then
  return acc_error('BADKEY')
end
local seq, inline, nbytes = ARGV[2], ARGV[5] == 'i', ARGV[7]
local spread, orphans = ARGV[5] == 'd', KEYS[8]
if not (is_count(seq) and is_int64(ARGV[3])
    and (inline or ARGV[5] == 'k' or ARGV[5] == 'p' or spread)
    and string.find(ARGV[4], '^[%d,]*$') and #ARGV[4] <= 2048 and is_count(nbytes)
    and is_count(ARGV[8]) and ARGV[8] ~= '0' and ARGV[9] and is_inst(ARGV[10]) and #ARGV <= 10
    and (not inline or (string.sub(ARGV[6], 1, 1) == 'i' and #ARGV[6] - 1 == tonumber(nbytes)))) then
  return acc_error('BADARG apply')
end
local entry = 'k' .. blob
if ARGV[5] == 'p' or spread then
  local parts = n_parts(tonumber(nbytes))
  if parts < 1 or parts > MAX_PARTS then return acc_error('BADARG apply parts') end
  entry = (spread and 'd' or 'p') .. int_str(parts) .. ' ' .. blob
end
local payload_keys = inline and {} or entry_keys(base, entry)
local err, st = read_state(state, ARGV[1], {'step', 'count', 'rshape', 'ttl', 'bytes',
  'n_applied', 'maxbytes', 'sum', 'sealed'}, ARGV[10])  -- (RECREATED: nothing of it touched)
local function drop_payload()  -- nobody will ever reference it
  if #payload_keys > 0 then unlink_all(payload_keys) end
  if spread and not err then
    -- its parts are the client's to delete at once (it holds the lease), else a sweeper's
    redis.call('ZREM', orphans, entry)
    discard_spread(base, orphans, {entry}, now_ms() + SWEEP_LEASE_MS)
  end
end
if err then
  drop_payload()
  return err
end
-- Refused before it could be judged (the ACL, a foreign value under one of its keys): its own
-- payload goes too, where this user may (a retrying worker would otherwise pile up a
-- gradient per try, each kept for an hour): its keys deleted, spread parts made garbage due
-- now (the next apply's sweep deletes them). Not the payload of a retry of an apply that was
-- counted (the ACL changed in between): the round holds it.
local function refuse_dropping(refusal)
  local allowed = redis.acl_check_cmd or function() return true end
  if inline or not allowed('GET', dedup) then return refusal end
  local prev = redis.pcall('GET', dedup)
  if type(prev) == 'table' then return refusal end
  -- (nor the payload of a late copy of an older apply: the apply it copies may be counted)
  if record_reached(prev, seq) then return refusal end
  if spread then
    -- (registered, in a zset: then neither write below can fail)
    local mark = redis.pcall('ZSCORE', orphans, entry)
    if type(mark) == 'string' and allowed('ZREM', orphans) and allowed('ZADD', orphans)
        and allowed('TIME') then
      local due = now_ms()
      redis.call('ZREM', orphans, entry)
      discard_spread(base, orphans, {entry}, due)
    end
  elseif #payload_keys > 0 and allowed('UNLINK', payload_keys[1]) then
    unlink_all(payload_keys)
  end
  return refusal
end
local step, count = st.step, tonumber(st.count)
local prev
if inline then
  -- A small gradient (most applies): no payload key to drop, and fewer calls (each costs
  -- ~2 us of Redis's thread; the type probes below were a tenth of an apply). Its reads and
  -- its first write are their own type checks, as pcalls before anything is written: the GET
  -- of the retry record here, the RPUSH of the round's list (the first write, below). The
  -- wake of a waiting taker after the writes is best effort: a foreign value there fails no
  -- apply (the taker's own script refuses it; a taker not woken re-checks within its slice).
  err = check_acl({'GET', dedup, 'SET', dedup, 'PEXPIRE', dedup, 'HSET', state,
    'HINCRBY', state, 'PEXPIRE', state, 'RPUSH', grads, 'PEXPIRE', grads, 'ZRANGE', KEYS[4],
    'HGET', KEYS[5], 'RPUSH', KEYS[6], 'LTRIM', KEYS[6]})
  if err then return err end
  prev = redis.pcall('GET', dedup)
  if type(prev) == 'table' then return probe_error('GET', dedup, 'string', prev.err) end
else
  err = check_acl({'GET', dedup, 'SET', dedup, 'UNLINK', blob, 'HSET', state,
    'HINCRBY', state, 'RPUSH', grads, 'PEXPIRE', state, 'PEXPIRE', grads, 'PEXPIRE', dedup,
    'PERSIST', blob, 'PEXPIRE', blob,
    'ZRANGE', KEYS[4], 'HGET', KEYS[5], 'RPUSH', KEYS[6], 'LTRIM', KEYS[6],
    'ZSCORE', orphans, 'ZREM', orphans, 'ZADD', orphans})
  if err then return refuse_dropping(err) end
  err = check_types({grads, 'list', dedup, 'string', KEYS[4], 'zset', KEYS[5], 'hash',
    KEYS[6], 'list', orphans, 'zset'})
  if err then return refuse_dropping(err) end  -- (a foreign value, or a refused probe)
  prev = redis.call('GET', dedup)
end

-- A retry of an apply this client already made (the reply was lost) is answered again, not
-- applied again. A copy of an older apply of this client (sent before an outage, delayed in
-- the network until the client had moved on: its outcome was settled by then, through a
-- retry or withdraw.lua's fence) is not applied either: the client sends its applies in
-- order, one at a time, so the record only moves forward.
if prev then
  local pseq, pres = string.match(prev, '^(%d+) ?(%-?%d*)$')
  if pseq == seq then
    redis.call('PEXPIRE', dedup, ARGV[8])
    -- the retry re-sent the payload with SET NX: a dropped one must not linger
    if pres == '0' then drop_payload() elseif spread then redis.call('ZREM', orphans, entry) end
    return {pres == '0' and 0 or 1, step, count, 1}
  end
  if is_count(pseq) and int_cmp(seq, pseq) < 0 then
    -- its payload keys are the copied apply's: held by a round if that apply was accepted
    -- (the copy's SET NX wrote nothing then; a spread copy registered its entry again)
    if inline or not round_holds(base, grads, base .. ':cl', entry, blob) then
      drop_payload()
    elseif spread then
      redis.call('ZREM', orphans, entry)
    end
    return {0, step, count, 1}
  end
end

-- The payload must be there, whole: a SET refused at maxmemory, an evicted or tampered key
-- would otherwise be accepted here and fail the take that claims it.
if spread then
  -- its parts were checked by the client; registered still, nobody sweeps them
  if not redis.call('ZSCORE', orphans, entry) then return acc_error('NOBLOB ' .. blob) end
elseif not inline then
  local len = entry_length(entry, payload_keys)
  if len ~= tonumber(nbytes) then
    drop_payload()  -- the parts that were written (the others refused, or evicted) go too
    return acc_error('NOBLOB ' .. blob)
  end
end

-- An accumulator that keeps its round's sum in Redis (st.sum: the accsum module's dtype) adds
-- a large payload into the round's running sum, the first entry of the round ('s' entry),
-- and frees it; the round's first payload becomes that sum. Everything is checked here,
-- before the first write: the module is loaded, the sum's parts are whole.
local into  -- {sum entry, its part keys} to add this payload into
local summing = st.sum and ARGV[5] == 'p'
if summing then
  local probe = redis.pcall('ACC.PING')
  if type(probe) == 'table' and probe.err then
    -- a user without +acc.ping is told so (Redis's text: "... can't run this command ...")
    if is_refusal(probe.err) then
      return refuse_dropping(acc_error('NOPERM ACC.PING -'))
    end
    drop_payload()
    return acc_error('NOMODULE')
  end
  err = check_acl({'ACC.ADD', blob, 'LSET', grads, 'LINDEX', grads})
  if err then return refuse_dropping(err) end
  if count > 0 then
    local head = redis.call('LINDEX', grads, '0')
    if head and string.sub(head, 1, 1) == 's' then
      local hkeys = entry_keys(base, head)
      if hkeys and hkeys[1] == payload_keys[1] then  -- (never this apply's own, nor dropped)
        return acc_error('BADARG apply: its payload key is the running sum\'s')
      end
      if hkeys and #hkeys == #payload_keys and entry_length(head, hkeys) == tonumber(nbytes) then
        into = {head, hkeys}
      end
    end
  end
end

local function refuse(code, detail)
  -- refused input is not remembered: a retry is judged again (it changed nothing). The
  -- payload goes first: at maxmemory, Redis refuses only a script's first write.
  drop_payload()
  redis.call('HINCRBY', state, 'n_rejected', '1')
  return {code, step, count, 0, detail}
end

local local_step = ARGV[3]
if int_cmp(local_step, step) < 0 then
  local behind = tonumber(step) - tonumber(local_step)
  local s = redis.call('HMGET', state, 'n_stale', 'stale_steps', 'max_stale')
  drop_payload()  -- first (see refuse)
  redis.call('HSET', state, 'n_stale', int_str(tonumber(s[1]) + 1),
    'stale_steps', int_str(tonumber(s[2]) + behind),
    'max_stale', int_str(math.max(tonumber(s[3]), behind)))
  redis.call('SET', dedup, seq .. ' 0', 'PX', ARGV[8])  -- "<seq>" alone means accepted
  return {0, step, count, 0}
end
-- sealed (seal.lua: its sync job finished at that step): no round will ever be taken again
if st.sealed then
  drop_payload()
  return {-4, step, count, 0, st.sealed}
end
if count > 0 and st.rshape and st.rshape ~= ARGV[4] then
  return refuse(-1, st.rshape)
end
if count == 0 and ARGV[9] ~= '' then
  return refuse(-2, ARGV[9])
end
-- a gradient added into the sum whole holds nothing apart; one folded in later does until then
local partial = into and #payload_keys > FOLD
local total = tonumber(st.bytes) + ((into and not partial) and 0 or tonumber(nbytes))
-- With the sum in Redis the limit counts what the round holds before this apply (the sum, and
-- what earlier gradients hold apart until their folds end), not this gradient, which adds
-- nothing to the sum and is held apart only for its own folds, as its parts were before this
-- script: a limit of 1.5 gradients refused the second of two applies made one after another.
local held = into and tonumber(st.bytes) or total
if st.maxbytes and held > tonumber(st.maxbytes) then
  return refuse(-3, st.maxbytes)
end

-- The first write: at maxmemory Redis refuses it (and only it), and the payload goes with
-- the refusal (a worker retrying would otherwise pile up a gradient per try, kept an hour).
-- An inline payload's first write is the RPUSH of the round's list: its type check too.
if inline then
  local first = redis.pcall('RPUSH', grads, ARGV[6])  -- already tagged 'i' by the client
  if type(first) == 'table' then return probe_error('RPUSH', grads, 'list', first.err) end
  redis.call('SET', dedup, seq, 'PX', ARGV[8])
else
  local first = redis.pcall('SET', dedup, seq, 'PX', ARGV[8])
  if type(first) == 'table' and first.err then
    drop_payload()
    return first
  end
  if spread then
    redis.call('ZREM', orphans, entry)  -- in the round now: no sweeper may touch its parts
    redis.call('RPUSH', grads, entry)
  elseif into then
    -- At most FOLD parts are added here; the client folds the rest in with fold.lua, a few
    -- parts per script (one script adding a 64 MiB gradient would block Redis ~25 ms).
    local n = #payload_keys
    local added = math.min(n, FOLD)
    add_parts(into[2], 0, payload_keys, added, st.sum)
    if not partial then
      count_in_sum(grads, into[1])
      payload_keys = into[2]  -- the sum's parts: their expiry follows the round's below
    else
      redis.call('RPUSH', grads, 'f' .. int_str(added) .. ' ' .. int_str(n) .. ' ' .. blob)
      local left = {}
      for i = added + 1, n do left[#left + 1] = payload_keys[i] end
      for _, key in ipairs(into[2]) do left[#left + 1] = key end
      payload_keys = left  -- its own parts still held, and the sum's
    end
  elseif summing then
    redis.call('RPUSH', grads, 's1 ' .. string.sub(entry, 2))
  else
    redis.call('RPUSH', grads, entry)
  end
end
count = count + 1
redis.call('HSET', state, 'count', int_str(count), 'bytes', int_str(total),
  'n_applied', int_str(tonumber(st.n_applied) + 1), 'rshape', ARGV[4])
local ttl, ttl_text = touch(state, {state, grads}, st.ttl)
-- the payload was written with an orphan expiry; accepted, it lives as long as the round
for _, key in ipairs(payload_keys) do
  if ttl > 0 then redis.call('PEXPIRE', key, ttl_text) else redis.call('PERSIST', key) end
end
wake_head(state, KEYS[4], KEYS[5], KEYS[6], count, inline)
if partial then return {1, step, count, 0, int_str(#payload_keys - #into[2])} end
return {1, step, count, 0}
