-- sync_lease: the chief lease of a sync job (accumulator.sync): one chief per job.
-- KEYS[1] lease hash (accsync:{tag}:chief: id, tenure, host, pid, since_ms, renewed_ms,
--         expires_ms)
-- ARGV[1] 'acquire' | 'renew' | 'release' | 'publish'  ARGV[2] chief id
-- ARGV[3] lease ms  ARGV[4] host  ARGV[5] pid  ARGV[6] ms the record of an expired lease is
--         kept (for `accumulator job`)  ARGV[7] (acquire, renew, release) the tenure: a token
--         of the chief's acquire, new at each (publish: the 'ten' field of the published hash)
-- A chief holds the lease from its acquire until another chief's: its renewals, publishes
-- and release are refused once the record names another id or another tenure (the same id
-- restarted), also after that other chief's lease ran out (it may have published since).
-- acquire: a new tenure, taken over from a holder whose lease ran out; {1, id of the holder
-- taken over or ''} or, when another chief's lease runs, {0, id, host, pid, ms left, ms since
-- its last renewal}.
-- renew: {1, ''}, or acquire's refusal when the lease is not this chief's tenure ({0, '', ..}:
-- no lease at all: a deleted job's lease is not brought back).
-- release: {1} when the lease was this chief's tenure (deleted), else {0}.
-- publish: renew (or acquire, when there is no lease at all and the published hash names this
-- tenure's last publish; else refused as renew is), then, only when the lease is
-- this chief's tenure, switch the job to the new version of its parameters, in the same
-- atomic step (fenced: no chief ever publishes over another). KEYS[2] the published hash
-- (accsync:{tag}:p)  KEYS[3 .. 2+n] the new version's part keys, written before this call
-- (under the tenure's own names: deleted when refused, unless the hash names them already)
-- KEYS[3+n .. #KEYS-m] the previous version's part keys (they expire after ARGV[10] ms)
-- KEYS[#KEYS-m+1 ..] the part keys of the version before that (deleted: Redis holds at most
-- the current and the previous version)
-- ARGV[7] n  ARGV[8] channel to announce the step on ('': the client does, after this call)
-- ARGV[9] the announcement  ARGV[10] ms  ARGV[11] m  ARGV[12 ..] field, value pairs of the
-- published hash (run, step, ten, ...).
-- The reply is acquire's.
-- Every mode: the lease key a job's (accsync:{tag}:chief), a chief id, the lease (ms), the
-- host, the pid and the record's keep as the client sends them, checked before any write.
local mode = ARGV[1]
local publish = mode == 'publish'
local base = type(KEYS[1]) == 'string' and string.match(KEYS[1], '^([^{}]+:{[^{}]*}):chief$')
if not (base and (mode == 'acquire' or mode == 'renew' or mode == 'release' or publish)
    and (publish or (#KEYS == 1 and (#ARGV == 6 or #ARGV == 7)))
    and (ARGV[2] or '') ~= '' and is_count(ARGV[3]) and ARGV[4]
    and is_count(ARGV[5]) and is_count(ARGV[6])
    and tonumber(ARGV[3]) + tonumber(ARGV[6]) < 2^50) then  -- (exact: expiries stay integers)
  return acc_error('BADARG sync_lease')
end
if publish then
  local n, m = tonumber(ARGV[7] or ''), tonumber(ARGV[11] or '')
  if not (KEYS[2] == base .. ':p'
      and is_count(ARGV[7] or '') and is_count(ARGV[10] or '') and is_count(ARGV[11] or '')
      and n + m + 2 <= #KEYS and #ARGV > 11 and (#ARGV - 11) % 2 == 0
      and (ARGV[8] == '' or ARGV[8] == base .. ':ch')) then
    return acc_error('BADARG sync_lease publish')
  end
  local head = base .. ':v:'
  for i = 3, #KEYS do
    if string.sub(KEYS[i], 1, #head) ~= head then return acc_error('BADKEY ' .. i) end
  end
  local checks = {'HMGET', KEYS[1], 'HSET', KEYS[1], 'DEL', KEYS[1], 'HMGET', KEYS[2],
    'PEXPIRE', KEYS[1], 'HSET', KEYS[2], 'UNLINK', head .. '0', 'PEXPIRE', head .. '0'}
  if ARGV[8] ~= '' then
    checks[#checks + 1] = 'PUBLISH'
    checks[#checks + 1] = ARGV[8]
  end
  local err = check_acl(checks)
  if err then return err end
end
local want = {}  -- (publish) the published hash's new fields
if publish then
  for i = 12, #ARGV - 1, 2 do want[ARGV[i]] = ARGV[i + 1] end
end
local tenure = (publish and want.ten or ARGV[7]) or ''
-- Whether the published hash names the version this call publishes already (a retry whose
-- first reply was lost): its parts are then being read, never deleted.
local function published_here()
  local have = redis.call('HMGET', KEYS[2], 'run', 'step', 'ten')
  return have[1] == want.run and have[2] == want.step and (have[3] or '') == (want.ten or '')
end
local now = now_ms()
local cur = redis.call('HMGET', KEYS[1], 'id', 'expires_ms', 'host', 'pid', 'renewed_ms',
  'tenure')
local holder = cur[1]
local mine = holder == ARGV[2] and (cur[6] or '') == tenure
if mode == 'release' then
  if mine then
    redis.call('DEL', KEYS[1])
    return {1}
  end
  return {0}
end
local expires = tonumber(cur[2] or '') or 0
if mode == 'renew' and not holder then
  return {0, '', '', '', '0', '0'}
end
-- A publish that finds no lease at all takes it only when the job's last publish was this
-- tenure's (the record expired, or Redis lost it alone): else the successor released it (or
-- deleted the job, or Redis lost its data), and this chief is as deposed as by a live one.
local lost_lease = publish and not holder
  and (redis.call('HMGET', KEYS[2], 'ten')[1] or '') ~= (want.ten or '')
if lost_lease or (holder and ((mode == 'acquire' and holder ~= ARGV[2] and expires > now)
    or (mode ~= 'acquire' and not mine))) then
  if publish and not published_here() then
    local n = tonumber(ARGV[7])
    for i = 3, 2 + n, 1000 do redis.call('UNLINK', unpack(KEYS, i, math.min(i + 999, 2 + n))) end
  end
  if lost_lease then return {0, '', '', '', '0', '0'} end
  local renewed = tonumber(cur[5] or '') or now
  return {0, holder, cur[3] or '', cur[4] or '', int_str(math.max(expires - now, 0)),
    int_str(now - renewed)}
end
local previous = ''
if not mine then
  previous = holder or ''
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'id', ARGV[2], 'tenure', tenure, 'host', ARGV[4],
             'pid', ARGV[5], 'since_ms', int_str(now))
end
redis.call('HSET', KEYS[1], 'renewed_ms', int_str(now),
           'expires_ms', int_str(now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], int_str(tonumber(ARGV[3]) + tonumber(ARGV[6])))
if publish then
  local fields = {}
  for i = 12, #ARGV do fields[#fields + 1] = ARGV[i] end
  redis.call('HSET', KEYS[2], unpack(fields))
  local stale = #KEYS - tonumber(ARGV[11])
  for i = 3 + tonumber(ARGV[7]), stale do redis.call('PEXPIRE', KEYS[i], ARGV[10]) end
  for i = stale + 1, #KEYS, 1000 do
    redis.call('UNLINK', unpack(KEYS, i, math.min(i + 999, #KEYS)))
  end
  if ARGV[8] ~= '' then redis.call('PUBLISH', ARGV[8], ARGV[9]) end
end
return {1, previous}
