-- open: create the accumulator if it does not exist, else return the creator's definition.
-- KEYS[1] state hash
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
-- Returns {1, def, sum, schema, inst} when created, {0, def, sum, schema, inst} when it
-- existed (the client compares definitions; sum = the stored module dtype or ''; schema: 2
-- or 3, what every other script of this accumulator is to be called with; inst = the stored
-- instance id, '' only when none was given).
local state = KEYS[1]
if not own_keys({}) then return acc_error('BADKEY 1') end
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
local err = check_acl({'HSET', state, 'PEXPIRE', state, 'HGET', state})
if err then return err end
redis.call('HSET', state,
  'schema', ARGV[1], 'def', ARGV[2], 'step', 0, 'count', 0, 'gen', 0, 'tseq', 0, 'bytes', 0,
  'ttl', ARGV[3], 'maxbytes', ARGV[4], 'created_ms', int_str(now_ms()),
  'n_applied', 0, 'n_stale', 0, 'stale_steps', 0, 'max_stale', 0, 'n_rejected', 0,
  'n_quarantined', 0, 'n_taken', 0, 'grads_taken', 0)
if ARGV[6] ~= '' then redis.call('HSET', state, 'sum', ARGV[6]) end
if (ARGV[7] or '') ~= '' then redis.call('HSET', state, 'inst', ARGV[7]) end
touch(state, {state})
return {1, ARGV[2], ARGV[6], ARGV[1], ARGV[7] or ''}
