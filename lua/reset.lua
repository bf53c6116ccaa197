-- reset: drop the pending round (count, round shape, payloads) and the quarantined entries,
-- without advancing the step; also the rounds claimed by takers that are gone (claim lease run
-- out: the next take would take them over). A claim whose lease runs is left to its taker.
-- KEYS[1] state  KEYS[2] grads list  KEYS[3] quarantine list  KEYS[4] orphans zset
-- KEYS[5] claim registry hash (taker id -> claim lease expiry ms)
-- ARGV[1] schema
-- Returns {number of gradients dropped (stranded claims' included), number of them that were
-- in stranded claims, blob key...}: the blob keys are not in KEYS, so the
-- client deletes them with a plain UNLINK after this script made them unreachable (and set
-- them to expire, in case it is cut short). Only this
-- accumulator's own payload keys are returned: an entry naming any other key is dropped
-- without touching that key. Spread payloads (parts in other slots) become garbage in the
-- orphans zset, due at once: the client sweeps them (orphans.lua).
local state, grads = KEYS[1], KEYS[2]
local registry = KEYS[5]
local base, kerr = own_keys({':g', ':x', ':o', ':cl'})
if not base then return kerr end
if #KEYS ~= 5 then return acc_error('BADKEY ' .. #KEYS) end
local err = read_state(state, ARGV[1], {'gen'})  -- (gen: checked before HINCRBY meets it)
if err then return err end
err = check_acl({'DEL', grads, 'DEL', KEYS[3], 'HSET', state, 'HDEL', state,
  'HINCRBY', state, 'UNLINK', base .. ':b:0:0', 'PEXPIRE', base .. ':b:0:0', 'ZADD', KEYS[4],
  'LRANGE', grads})
if err then return err end
err = check_types({grads, 'list', KEYS[4], 'zset'})
if err then return err end
local entries = redis.call('LRANGE', grads, '0', '-1')
local spread = false
for _, entry in ipairs(entries) do spread = spread or string.sub(entry, 1, 1) == 'd' end
-- The claims in flight (a user who may not read them has none to drop: a read, no write).
local marks = redis.pcall('HGETALL', registry)
if type(marks) == 'table' and marks.err then
  if not is_refusal(marks.err) then return probe_error('HGETALL', registry, 'hash', marks.err) end
  marks = {}
end
-- What is read from here on, before the first write, needs the time (clocks: TIME only then).
local now = 0
if spread or #marks > 0 then
  err = check_acl({'TIME', false})
  if err then return err end
  now = now_ms()
end
-- the stranded claims: their entries join the round's (the header, first, is no entry)
local stranded, in_claims = {}, 0
for i = 1, #marks, 2 do
  local expiry, claim = tonumber(marks[i + 1]), base .. ':c:' .. marks[i]
  if expiry and expiry <= now and is_own(base, claim, 'c') then
    if #stranded == 0 then
      err = check_acl({'LRANGE', claim, 'DEL', claim, 'HDEL', registry})
      if err then return err end
    end
    local held = redis.pcall('LRANGE', claim, '1', '-1')
    if type(held) == 'table' and not held.err then  -- (a foreign value: not ours to judge)
      stranded[#stranded + 1] = {marks[i], claim}
      for _, entry in ipairs(held) do
        entries[#entries + 1] = entry
        in_claims = in_claims + entry_weight(entry)
      end
    end
  end
end
local blobs, dropped = {0, in_claims}, 0
for _, entry in ipairs(entries) do
  dropped = dropped + entry_weight(entry)
  for _, key in ipairs(entry_keys(base, entry) or {}) do blobs[#blobs + 1] = key end
end
blobs[1] = dropped
-- a delete first: at maxmemory Redis refuses a script's first write if it needs memory, and
-- a reset is how a full server is freed
redis.call('DEL', grads, KEYS[3])
-- the payloads expire unless the client unlinks them first (cut short, it left them forever)
for i = 3, #blobs do redis.call('PEXPIRE', blobs[i], DROPPED_TTL_MS) end
for _, s in ipairs(stranded) do
  redis.call('DEL', s[2])
  redis.call('HDEL', registry, s[1])
end
discard_spread(base, KEYS[4], entries, now)
redis.call('HSET', state, 'count', '0', 'bytes', '0')
redis.call('HDEL', state, 'rshape')
redis.call('HINCRBY', state, 'gen', '1')
return blobs
