-- open: create the accumulator if it does not exist, else return the creator's definition.
-- KEYS[1] state hash  KEYS[2] grads list  KEYS[3] quarantine list  KEYS[4] orphans zset
-- KEYS[5] claim registry hash (taker id -> claim lease expiry ms)  KEYS[6] takers zset
-- KEYS[7] taker info hash
-- ARGV[1] schema version of a new accumulator: 2, or 3 when its large payloads are to be
--         spread over slots ('d' entries; clients speaking 2 only then refuse it)
-- ARGV[2] definition (msgpack)  ARGV[3] safety-net ttl ms (0 = none)
-- ARGV[4] pending-bytes limit  ARGV[5] '1' when the opener chose that limit explicitly (it
--         then replaces the stored one), '0' when it is the library default (kept if set)
-- ARGV[6] the accsum module's dtype when a new accumulator keeps its sums in Redis, else ''
--         (decided once, at creation: every client of it then agrees)
-- ARGV[7] an instance id for a new accumulator (hex, up to 32 digits; absent or '': none):
--         stored at creation (or at the first open of one an older client made), it tells
--         this accumulator from one deleted and created again under the same name (the calls
--         of an object opened on another are refused: check_inst in _common.lua)
-- Returns {1, def, sum, schema, inst, dropped} when created, {0, def, sum, schema, inst}
-- when it existed (the client compares definitions; sum = the stored module dtype or '';
-- schema: 2 or 3, what every other script of this accumulator is to be called with; inst =
-- the stored instance id, '' only when none was given; dropped: the gradients of the remains
-- below, dropped at the creation).
--
-- Remains: an accumulator whose state hash alone was lost (evicted under an allkeys-*
-- maxmemory-policy, deleted by hand) leaves its pending round, the rounds its takers had
-- claimed and its queue of takers. A new accumulator created under its name must not take
-- them (another accumulator's gradients, in a round its count leaves out): they are dropped
-- with the creation, their payloads set to expire (spread ones made garbage for a sweeper).
local state, grads, quarantine, orphans, registry = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local takers, info = KEYS[6], KEYS[7]
local base, kerr = own_keys({':g', ':x', ':o', ':cl', ':t', ':ti'})
if not base then return kerr end
if #KEYS ~= 7 then return acc_error('BADKEY ' .. #KEYS) end
if not (is_count(ARGV[3]) and is_count(ARGV[4]) and (ARGV[5] == '0' or ARGV[5] == '1')
    and (ARGV[6] == '' or SUM_DTYPES[ARGV[6]]) and (ARGV[1] == '2' or ARGV[1] == '3')
    and is_inst(ARGV[7]) and #ARGV <= 7) then
  return acc_error('BADARG open')
end
local have = redis.pcall('HGET', state, 'schema')
if type(have) == 'table' and have.err then return refused('HGET', state, have.err) end
if have then
  if have ~= '2' and have ~= '3' then return acc_error('SCHEMA ' .. have) end
  local err = check_acl({'HSET', state, 'HSETNX', state, 'HMGET', state})
  if err then return err end
  if ARGV[5] == '1' then
    redis.call('HSET', state, 'maxbytes', ARGV[4])
  else
    redis.call('HSETNX', state, 'maxbytes', ARGV[4])  -- written by an older version: none yet
  end
  -- one created by an older client has no instance id: it gets this one (as if created now)
  if (ARGV[7] or '') ~= '' then redis.call('HSETNX', state, 'inst', ARGV[7]) end
  local stored = redis.call('HMGET', state, 'def', 'sum', 'inst')
  return {0, stored[1], stored[2] or '', have, stored[3] or ''}
end
local err = check_acl({'HSET', state, 'PEXPIRE', state, 'HGET', state, 'LRANGE', grads,
  'HGETALL', registry, 'EXISTS', quarantine, 'EXISTS', takers})
if err then return err end
err = check_types({grads, 'list', quarantine, 'list', orphans, 'zset', registry, 'hash'})
if err then return err end
local entries, claims = redis.call('LRANGE', grads, '0', '-1'), {}
local marks = redis.call('HGETALL', registry)
for i = 1, #marks, 2 do
  local claim = base .. ':c:' .. marks[i]
  if is_own(base, claim, 'c') then
    err = check_acl({'LRANGE', claim})
    if err then return err end
    local held = redis.pcall('LRANGE', claim, '1', '-1')  -- (the header, first, is no entry)
    if type(held) == 'table' and not held.err then
      claims[#claims + 1] = claim
      for _, entry in ipairs(held) do entries[#entries + 1] = entry end
    end
  end
end
local dropped, spread, now = 0, false, 0
for _, entry in ipairs(entries) do
  dropped = dropped + entry_weight(entry)
  spread = spread or string.sub(entry, 1, 1) == 'd'
end
-- (a taker of the old one still queued would hold up this one's takes for its lease)
local remains = #entries > 0 or #marks > 0
  or redis.call('EXISTS', quarantine, takers) > 0
if remains then
  err = check_acl({'DEL', grads, 'PEXPIRE', base .. ':b:0:0', 'ZADD', orphans,
    'TIME', false, 'DEL', base .. ':c:0-0'})
  if err then return err end
  if spread then now = now_ms() end
end
redis.call('HSET', state,
  'schema', ARGV[1], 'def', ARGV[2], 'step', 0, 'count', 0, 'gen', 0, 'tseq', 0, 'bytes', 0,
  'ttl', ARGV[3], 'maxbytes', ARGV[4], 'created_ms', int_str(now_ms()),
  'n_applied', 0, 'n_stale', 0, 'stale_steps', 0, 'max_stale', 0, 'n_rejected', 0,
  'n_quarantined', 0, 'n_taken', 0, 'grads_taken', 0)
if ARGV[6] ~= '' then redis.call('HSET', state, 'sum', ARGV[6]) end
if (ARGV[7] or '') ~= '' then redis.call('HSET', state, 'inst', ARGV[7]) end
touch(state, {state})
if remains then
  for _, entry in ipairs(entries) do
    for _, key in ipairs(entry_keys(base, entry) or {}) do
      redis.call('PEXPIRE', key, DROPPED_TTL_MS)
    end
  end
  discard_spread(base, orphans, entries, now)
  for _, claim in ipairs(claims) do redis.call('DEL', claim) end
  redis.call('DEL', grads, quarantine, registry, takers, info)
end
return {1, ARGV[2], ARGV[6], ARGV[1], ARGV[7] or '', dropped}
