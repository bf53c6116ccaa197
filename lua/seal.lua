-- seal: the accumulator's sync job (accumulator.sync) finished: every apply that is not stale
-- is refused from now on (apply.lua, code -4), so that no gradient goes into a round nobody
-- will take. Idempotent; the job's chief seals every accumulator of the job after publishing
-- its final step (and again when a chief is started on the finished job).
-- KEYS[1] state
-- ARGV[1] schema  ARGV[2] the job's final step (a decimal int64)
-- ARGV[3] the instance id the chief's object opened (absent or '': unchecked; see check_inst)
-- Returns 1.
local state = KEYS[1]
if not own_keys({}) then return acc_error('BADKEY 1') end
if not is_int64(ARGV[2]) or not is_inst(ARGV[3]) then return acc_error('BADARG seal') end
local err, st = read_state(state, ARGV[1], {'ttl'}, ARGV[3])
if err then return err end
err = check_acl({'HSET', state, 'PEXPIRE', state})
if err then return err end
redis.call('HSET', state, 'sealed', ARGV[2])
touch(state, {state}, st.ttl)
return 1
