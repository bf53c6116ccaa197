-- withdraw: the parts of an apply abandoned half-way (interrupted while it sent them, or its
-- reply lost past the retry window) are deleted, unless the apply was counted (this client's
-- retry record holds its seq): then the round holds them. Without this they would stay until
-- their orphan expiry (an hour), counted against maxmemory.
-- KEYS[1] state  KEYS[2] dedup key of this client  KEYS[3] blob key
-- ARGV[1] client seq of the apply  ARGV[2] payload bytes
-- Returns how many part keys it deleted (0: counted, or none was there).
-- Touches only the payload's own part keys; every input and permission is checked first.
local dedup, blob, seq = KEYS[2], KEYS[3], ARGV[1]
local base, kerr = own_keys({'', ''})
if not base then return kerr end
if not is_own(base, dedup, 'd') or not is_own(base, blob, 'b') then return acc_error('BADKEY') end
if not (is_count(seq) and is_count(ARGV[2])) then return acc_error('BADARG withdraw') end
local parts = n_parts(tonumber(ARGV[2]))
if parts < 1 or parts > MAX_PARTS then return acc_error('BADARG withdraw parts') end
local err = check_acl({'GET', dedup, 'UNLINK', blob})
if err then return err end
local prev = redis.pcall('GET', dedup)
if type(prev) == 'table' then return refused('GET', dedup, prev.err) end
if prev and string.match(prev, '^(%d+)') == seq then return 0 end
return unlink_all(entry_keys(base, 'p' .. int_str(parts) .. ' ' .. blob))
