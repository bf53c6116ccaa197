-- sync_count: count one push of a sync job's worker (accumulator.sync), once: a retry after a
-- lost reply is recognised by its push id.
-- KEYS[1] stats hash (accsync:{tag}:st)
-- ARGV[1] worker id  ARGV[2] push id  ARGV[3] '' (every tensor accepted) | 'stale' | 'partial'
-- Writes 'pushes' (and 'stale' | 'partial') for the job and 'w:<id>:pushes|stale|partial',
-- 'w:<id>:push' (this push id) and 'w:<id>:seen_ms' (server time) for the worker.
-- Returns 1 when counted, 0 when this push id was counted already.
local p = 'w:' .. ARGV[1] .. ':'
if redis.call('HGET', KEYS[1], p .. 'push') == ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], p .. 'push', ARGV[2], p .. 'seen_ms', int_str(now_ms()))
redis.call('HINCRBY', KEYS[1], 'pushes', 1)
redis.call('HINCRBY', KEYS[1], p .. 'pushes', 1)
if ARGV[3] ~= '' then
  redis.call('HINCRBY', KEYS[1], ARGV[3], 1)
  redis.call('HINCRBY', KEYS[1], p .. ARGV[3], 1)
end
return 1
