-- withdraw: the parts of an apply abandoned half-way (interrupted while it sent them, or its
-- reply lost past the retry window) are deleted, unless the apply was counted (this client's
-- retry record holds its seq): then the round holds them. Without this they would stay until
-- their orphan expiry (an hour), counted against maxmemory.
-- With ARGV[3] (a retry-record ttl in ms) it also settles the apply: one whose reply was lost
-- (the client raised UnavailableError) and that it will not send again. Not counted, it never
-- will be: its retry record is written as a dropped one, so a copy Redis has yet to run (sent
-- before the outage) is answered as a retry, not counted.
-- KEYS[1] state  KEYS[2] dedup key of this client  KEYS[3] blob key
-- ARGV[1] client seq of the apply  ARGV[2] payload bytes  ARGV[3] '' or absent | fence ttl ms
-- Returns how many part keys it deleted (the apply was not judged; with a fence, now it never
-- will be), or, nothing deleted: -1 it was counted (the retry record holds its seq), -2 it
-- was not (the record holds its seq as dropped: stale, or fenced before), -3 the record holds
-- a later apply of this client (its outcome is no longer known here; nothing is written).
-- Touches only the payload's own part keys and this client's retry record; every input and
-- permission is checked first. (Reads the pending round and the claims when the record is
-- gone: see round_holds.)
local dedup, blob, seq = KEYS[2], KEYS[3], ARGV[1]
local base, kerr = own_keys({'', ''})
if not base then return kerr end
if not is_own(base, dedup, 'd') or not is_own(base, blob, 'b')
    or blob ~= apply_blob(base, dedup, seq) then
  return acc_error('BADKEY')
end
local fence = ARGV[3] or ''
if not (is_count(seq) and is_count(ARGV[2]) and (fence == '' or (is_count(fence) and fence ~= '0'))) then
  return acc_error('BADARG withdraw')
end
local parts = n_parts(tonumber(ARGV[2]))
if parts < 1 or parts > MAX_PARTS then return acc_error('BADARG withdraw parts') end
local grads, claims = base .. ':g', base .. ':cl'
local err = check_acl(fence == '' and {'GET', dedup, 'UNLINK', blob, 'LRANGE', grads, 'HGETALL', claims}
  or {'GET', dedup, 'UNLINK', blob, 'LRANGE', grads, 'HGETALL', claims, 'EXISTS', KEYS[1], 'SET', dedup})
if err then return err end
local prev = redis.pcall('GET', dedup)
if type(prev) == 'table' then return refused('GET', dedup, prev.err) end
local pseq, pres = string.match(prev or '', '^(%d+) ?(%-?%d*)$')
if pseq == seq then return pres == '' and -1 or -2 end
if is_count(pseq) and int_cmp(pseq, seq) > 0 then return -3 end
-- No record at all (it expired: an outage longer than its ttl): a round that holds the
-- payload says the apply was counted (its parts must stay; nothing is written).
local entry = 'p' .. int_str(parts) .. ' ' .. blob
if not prev and round_holds(base, grads, claims, entry, blob) then return -1 end
-- (the deletes first: at maxmemory Redis refuses the SET below, never an UNLINK)
local deleted = unlink_all(entry_keys(base, 'p' .. int_str(parts) .. ' ' .. blob))
-- (an accumulator deleted since: a late copy is refused as NOTFOUND, nothing to fence)
if fence ~= '' and redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('SET', dedup, seq .. ' 0', 'PX', fence)
end
return deleted
