-- sync_lease: the chief lease of a sync job (accumulator.sync): one chief per job.
-- KEYS[1] lease hash (accsync:{tag}:chief: id, host, pid, since_ms, renewed_ms, expires_ms)
-- ARGV[1] 'acquire' (also renews) | 'renew' (only a lease this chief holds: a deleted job's
--         lease is not brought back) | 'release'  ARGV[2] chief id  ARGV[3] lease ms
-- ARGV[4] host  ARGV[5] pid  ARGV[6] ms the record of an expired lease is kept (for
--         `accumulator job`)
-- acquire: {1, id of an expired holder taken over or ''} or, when another chief's lease runs,
-- {0, id, host, pid, ms left, ms since its last renewal}.
-- release: {1} when the lease was this chief's (deleted), else {0}.
local now = now_ms()
local cur = redis.call('HMGET', KEYS[1], 'id', 'expires_ms', 'host', 'pid', 'renewed_ms')
local holder = cur[1]
if ARGV[1] == 'release' then
  if holder == ARGV[2] then
    redis.call('DEL', KEYS[1])
    return {1}
  end
  return {0}
end
local expires = tonumber(cur[2] or '') or 0
if ARGV[1] == 'renew' and holder ~= ARGV[2] then
  if not holder then return {0, '', '', '', '0', '0'} end
elseif ARGV[1] ~= 'acquire' and ARGV[1] ~= 'renew' then
  return acc_error('BADARG sync_lease')
end
if holder and holder ~= ARGV[2] and expires > now then
  local renewed = tonumber(cur[5] or '') or now
  return {0, holder, cur[3] or '', cur[4] or '', int_str(expires - now), int_str(now - renewed)}
end
local previous = ''
if holder ~= ARGV[2] then
  previous = holder or ''
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'id', ARGV[2], 'host', ARGV[4], 'pid', ARGV[5],
             'since_ms', int_str(now))
end
redis.call('HSET', KEYS[1], 'renewed_ms', int_str(now),
           'expires_ms', int_str(now + tonumber(ARGV[3])))
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) + tonumber(ARGV[6]))
return {1, previous}
