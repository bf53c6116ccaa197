-- reset: drop the pending round (count, round shape, payloads) and the quarantined entries,
-- without advancing the step.
-- KEYS[1] state  KEYS[2] grads list  KEYS[3] quarantine list  KEYS[4] orphans zset
-- ARGV[1] schema
-- Returns {number of gradients dropped, blob key...}: the blob keys are not in KEYS, so the
-- client deletes them with a plain UNLINK after this script made them unreachable. Only this
-- accumulator's own payload keys are returned: an entry naming any other key is dropped
-- without touching that key. Spread payloads (parts in other slots) become garbage in the
-- orphans zset, due at once: the client sweeps them (orphans.lua).
local state, grads = KEYS[1], KEYS[2]
local base, kerr = own_keys({':g', ':x', ':o'})
if not base then return kerr end
local err = check_schema(state, ARGV[1])
if err then return err end
err = check_acl({'DEL', grads, 'DEL', KEYS[3], 'HSET', state, 'HDEL', state,
  'HINCRBY', state, 'UNLINK', base .. ':b:0:0', 'ZADD', KEYS[4], 'LRANGE', grads})
if err then return err end
err = check_types({grads, 'list', KEYS[4], 'zset'})
if err then return err end
local entries = redis.call('LRANGE', grads, '0', '-1')
local blobs, dropped, spread = {0}, 0, false
for _, entry in ipairs(entries) do
  dropped = dropped + entry_weight(entry)
  for _, key in ipairs(entry_keys(base, entry) or {}) do blobs[#blobs + 1] = key end
  spread = spread or string.sub(entry, 1, 1) == 'd'
end
blobs[1] = dropped
local now = 0
if spread then  -- (read before the first write, as everything that may be refused)
  err = check_acl({'TIME', false})
  if err then return err end
  now = now_ms()
end
-- a delete first: at maxmemory Redis refuses a script's first write if it needs memory, and
-- a reset is how a full server is freed
redis.call('DEL', grads, KEYS[3])
discard_spread(base, KEYS[4], entries, now)
redis.call('HSET', state, 'count', '0', 'bytes', '0')
redis.call('HDEL', state, 'rshape')
redis.call('HINCRBY', state, 'gen', '1')
return blobs
