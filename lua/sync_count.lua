-- sync_count: count one push of a sync job's worker (accumulator.sync), once: a retry after a
-- lost reply is recognised by its push id.
-- KEYS[1] stats hash (accsync:{tag}:st)  KEYS[2] the job's published hash (accsync:{tag}:p):
--         gone (the job deleted), nothing is counted (a straggler's push would bring a key
--         of the job back, without expiry)
-- ARGV[1] worker id  ARGV[2] push id (hex)  ARGV[3] its outcome: '' (every tensor accepted)
--         | 'stale' | 'partial' | 'none' (not a push: it met the end of the job)
-- Writes 'pushes' (and 'stale' | 'partial') for the job and 'w:<id>:pushes|stale|partial',
-- 'w:<id>:push' (this push id), 'w:<id>:push_as' (the outcome it is counted as) and
-- 'w:<id>:seen_ms' (server time) for the worker.
-- The worker counts a push in the round trip of its applies, before it knows their outcome,
-- as '' (the common case); a call again with the same push id and another outcome amends the
-- count (moves it from one outcome's counters to the other's, or out: 'none').
-- Returns 1 when counted, 2 when amended, 0 when this push id was counted so already, -1
-- when there is no job.
-- Every input and permission is checked before the first write.
local what = ARGV[3]
if not (string.sub(KEYS[1], -3) == ':st' and KEYS[2] == string.sub(KEYS[1], 1, -4) .. ':p'
    and type(ARGV[1]) == 'string' and #ARGV[1] > 0
    and type(ARGV[2]) == 'string' and string.find(ARGV[2], '^%x+$')
    and (what == '' or what == 'stale' or what == 'partial' or what == 'none')) then
  return acc_error('BADARG sync_count')
end
local err = check_acl({'HMGET', KEYS[1], 'HSET', KEYS[1], 'HINCRBY', KEYS[1],
  'EXISTS', KEYS[2]})
if err then return err end
if redis.call('EXISTS', KEYS[2]) == 0 then return -1 end
local p = 'w:' .. ARGV[1] .. ':'

-- the counters a push counted as `outcome` adds to
local function counters(outcome, into)
  if outcome == 'none' then return into end
  into[#into + 1] = 'pushes'
  into[#into + 1] = p .. 'pushes'
  if outcome ~= '' then
    into[#into + 1] = outcome
    into[#into + 1] = p .. outcome
  end
  return into
end

local function add(outcome, by)
  for _, field in ipairs(counters(outcome, {})) do
    redis.call('HINCRBY', KEYS[1], field, by)
  end
end

local last = redis.call('HMGET', KEYS[1], p .. 'push', p .. 'push_as')
local was = nil
if last[1] == ARGV[2] then
  was = last[2] or ''
  if was == what then return 0 end
end
-- every counter this call changes holds an integer (or nothing yet): HINCRBY cannot fail
-- half-way through
local touched = counters(what, was and counters(was, {}) or {})
if #touched > 0 then
  local values = redis.call('HMGET', KEYS[1], unpack(touched))
  for i = 1, #touched do
    local v = values[i]
    if v and not (string.find(v, '^%-?%d+$') and #v < 19) then
      return acc_error('BADSTATE sync stats field ' .. touched[i] .. ' is not a count')
    end
  end
end
if was then
  add(was, -1)
  add(what, 1)
  redis.call('HSET', KEYS[1], p .. 'push_as', what)
  return 2
end
redis.call('HSET', KEYS[1], p .. 'push', ARGV[2], p .. 'push_as', what,
  p .. 'seen_ms', int_str(now_ms()))
add(what, 1)
return 1
