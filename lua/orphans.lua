-- orphans: register a spread payload before its parts are written, and hand out garbage: spread
-- payloads dropped, taken, quarantined or never applied, whose parts the caller is to delete.
-- Their parts live in other slots (see spread_parts in _common.lua): no script can delete them,
-- so the orphans zset records every spread payload that is not in a round or a claim, and
-- whoever runs this script next (an apply of a spread payload, an admin) sweeps it.
-- KEYS[1] state  KEYS[2] orphans zset
-- ARGV[1] schema  ARGV[2] the spread entry to register ('' = none), 'd<parts> <blob key>'
-- ARGV[3] how long a registration lasts, ms: an apply that has not recorded its payload by then
--         is taken for dead (its registration becomes garbage; apply.lua then refuses it)
-- ARGV[4] how many garbage members to hand out, at most  ARGV[5] the caller's lease on them, ms
-- ARGV[6] the instance id of the registering apply's object (absent or '': unchecked; see
--         check_inst): an apply refused so registers nothing in the new accumulator
-- Returns the members handed out, each 'x' .. entry: the caller deletes their parts, then ZREMs
-- them (a caller that dies leaves them to the next sweeper once its lease ran out).
local base, kerr = own_keys({':o'})
if not base then return kerr end
local orphans, entry = KEYS[2], ARGV[2]
if not (is_count(ARGV[3]) and is_count(ARGV[4]) and tonumber(ARGV[4]) <= 1000
    and is_count(ARGV[5]) and is_inst(ARGV[6])) or (entry ~= '' and not spread_parts(base, entry)) then
  return acc_error('BADARG orphans')
end
local err = read_state(KEYS[1], ARGV[1], {}, ARGV[6])
if err then return err end
err = check_acl({'ZADD', orphans, 'ZREM', orphans, 'ZRANGEBYSCORE', orphans,
  'GET', base .. ':d:0', 'LRANGE', base .. ':g', 'HGETALL', base .. ':cl'})
if err then return err end
err = check_types({orphans, 'zset'})
if err then return err end
-- A late copy of a registration (its reply was lost, and the client went on: its apply, or a
-- later one, has run since, as the client's retry record says) registers the payload only if
-- no round holds it: a sweeper would delete the parts of a counted gradient.
local register = entry ~= ''
if register then
  local cid, seq = string.match(entry, ':b:(%x+):(%d+)$')
  if record_reached(redis.pcall('GET', base .. ':d:' .. cid), seq) then
    register = not round_holds(base, base .. ':g', base .. ':cl', entry,
      string.match(entry, ' (.+)$'))
  end
end
local now = now_ms()
if register then
  redis.call('ZADD', orphans, 'NX', int_str(now + tonumber(ARGV[3])), entry)
end
local out = {}
if tonumber(ARGV[4]) == 0 then return out end
local lease = now + tonumber(ARGV[5])
local due = redis.call('ZRANGEBYSCORE', orphans, '-inf', int_str(now), 'LIMIT', 0, ARGV[4])
for _, member in ipairs(due) do
  -- garbage, or a registration that ran out (garbage now): leased to the caller if it is one
  -- of ours, dropped if it is anything else (not ours to follow)
  redis.call('ZREM', orphans, member)
  local entry_of = string.sub(member, 1, 1) == 'x' and string.sub(member, 2) or member
  for _, garbage in ipairs(discard_spread(base, orphans, {entry_of}, lease)) do
    out[#out + 1] = garbage
  end
end
return out
