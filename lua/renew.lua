-- renew: a taker still reading its claimed round extends the claim's lease, so that a slow
-- reader that makes progress keeps its round and only one that stopped is taken for gone (two
-- takers slower than the lease's allowance took one big round from each other forever).
-- KEYS[1] state  KEYS[2] claim list of this taker  KEYS[3] claim registry hash
-- ARGV[1] taker id  ARGV[2] claim lease ms (the base)  ARGV[3] extra ms per MiB of payload
-- ARGV[4] the claim's payload bytes  ARGV[5] its entries (as the take script's reply gave them)
-- Returns 1: the claim is this taker's, leased again as long as at its claim (from now; never
-- shortened); 0: it is not (taken over, evicted, given back, or gone with the accumulator).
-- A lease that ran out with nobody taking the round over is this taker's still, as for
-- finish.lua.
local base, kerr = own_keys({'', ':cl'})
if not base then return kerr end
local claim, me, registry = KEYS[2], ARGV[1], KEYS[3]
if #KEYS ~= 3 or #ARGV ~= 5 or claim ~= base .. ':c:' .. me or not is_own(base, claim, 'c')
    or not is_count(ARGV[2]) or not is_count(ARGV[3])
    or not is_count(ARGV[4]) or not is_count(ARGV[5]) then
  return acc_error('BADARG renew')
end
local err = check_acl({'HSET', registry, 'HDEL', registry, 'HGET', registry, 'EXISTS', claim,
  'TIME', false})
if err then return err end
err = check_types({registry, 'hash', claim, 'list'})
if err then return err end
local expiry = tonumber(redis.call('HGET', registry, me) or '')
if not expiry or redis.call('EXISTS', claim) == 0 then return 0 end
local lease = now_ms() + claim_lease_ms(ARGV[2], ARGV[3], ARGV[4], tonumber(ARGV[5]))
if lease > expiry then
  -- a delete first: at maxmemory Redis refuses a script's first write if it needs memory,
  -- and a reader must keep its round there (its reads and its finish still work)
  redis.call('HDEL', registry, me)
  redis.call('HSET', registry, me, int_str(lease))
end
return 1
