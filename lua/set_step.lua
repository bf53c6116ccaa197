-- set_step: set the global step (also downwards); never touches the round.
-- KEYS[1] state
-- ARGV[1] schema  ARGV[2] new global step (a decimal int64)
-- ARGV[3] the instance id the client's object opened (absent or '': unchecked; see check_inst)
-- Returns the previous step (as a string, to keep int64 exact).
local state = KEYS[1]
if not own_keys({}) then return acc_error('BADKEY 1') end
if not is_int64(ARGV[2]) or not is_inst(ARGV[3]) then return acc_error('BADARG set_step') end
local err, st = read_state(state, ARGV[1], {'ttl'}, ARGV[3])
if err then return err end
err = check_acl({'HSET', state, 'PEXPIRE', state})
if err then return err end
local old = redis.call('HGET', state, 'step')
redis.call('HSET', state, 'step', ARGV[2])
touch(state, {state}, st.ttl)
return old
