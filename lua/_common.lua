-- Prelude shared by every script: accumulator/_scripts.py prepends this file to each one.
-- Key layout: see accumulator/_keys.py (the one place it is written down).
-- Errors are returned as replies starting with "ACCERR " so the client can match the prefix
-- (Redis appends script details to error texts; fakeredis does not).

local function acc_error(what)
  return redis.error_reply('ACCERR ' .. what)
end

-- Whether a redis.pcall error is a refusal by the ACL (a script's "can't run this command").
local function is_refusal(err)
  local text = tostring(err)  -- (a string; fakeredis's Lua gives a userdata)
  return string.find(text, "can't run", 1, true) or string.find(text, 'NOPERM', 1, true)
    or string.find(text, "can't access", 1, true)
    or string.find(text, 'no permissions', 1, true)
end

-- The error reply for a read that failed (redis.pcall's error): a refusal by the ACL says
-- which command and key (Redis's own text does not), anything else as it is.
local function refused(command, key, err)
  if is_refusal(err) then return acc_error('NOPERM ' .. command .. ' ' .. key) end
  return redis.error_reply(tostring(err))
end

-- The error reply for a pcall on key that failed with err: BADTYPE when the key holds a value
-- of another type than kind, our NOPERM when the ACL refused it, else the error as it is.
local function probe_error(command, key, kind, err)
  local text = tostring(err)  -- (a string; fakeredis's Lua gives a userdata)
  if string.find(text, 'WRONGTYPE', 1, true) then
    return acc_error('BADTYPE ' .. key .. ' ' .. kind)
  end
  return refused(command, key, err)
end

-- An instance id as open.lua stores it (hex, 32 digits at most), or '' / absent (none).
local function is_inst(s)
  return string.find(s or '', '^%x*$') ~= nil and #(s or '') <= 32
end

-- The instance check (open.lua gives each new accumulator an id; an object's calls carry the
-- one it opened): a call of an object that opened an accumulator since deleted and created
-- again under its name is refused as NOTFOUND would be, before it reads or writes anything of
-- the new one. `want` absent or '' (hand-made calls, older clients): unchecked. No stored id
-- is another accumulator too: open.lua gives one to every accumulator it opens, so one without
-- was created again since (by an older client, or by hand).
local function check_inst(stored, want)
  if (want or '') ~= '' and stored ~= want then return acc_error('RECREATED') end
  return nil
end

-- Integers as decimal strings. Lua's own number-to-string conversion ('%.14g') turns
-- 10^14 into "1e+14"; every integer this library writes or concatenates goes through this.
local function int_str(x)
  return string.format('%.0f', x)
end

local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

-- Private accumulators expire as a safety net; every write renews the deadline.
-- ttl: the state's 'ttl' field when the caller has read it already. Returns the ttl as a
-- number and as the field's text (numbers given to redis.call cost a printf each).
local function touch(state, keys, ttl)
  ttl = ttl or redis.call('HGET', state, 'ttl') or '0'
  local ms = tonumber(ttl)
  if ms > 0 then
    if not string.find(ttl, '^[1-9]%d*$') then ttl = int_str(ms) end  -- (an older open.lua's)
    for _, key in ipairs(keys) do redis.call('PEXPIRE', key, ttl) end
  end
  return ms, ttl
end

-- Taker info is "<num_required> <lease expiry ms> <joined ms>".
local function taker_info(info)
  local n, expiry, joined = string.match(info, '^(%d+) (%d+) (%d+)$')
  return tonumber(n), tonumber(expiry), tonumber(joined)
end

-- The head of the FIFO changed: every queued taker re-checks. A broadcast (pub/sub), not list
-- tokens: a queued taker that re-checked could pop a token meant for the new head.
local function wake_queue(channel)
  redis.call('PUBLISH', channel, '1')
end

-- count: the round's count when the caller knows it. best_effort: the caller has not checked
-- the types of takers, info_key and wake; a foreign value there means no wake (pcalls).
local function wake_head(state, takers, info_key, wake, count, best_effort)
  local call = best_effort and redis.pcall or redis.call
  local head = call('ZRANGE', takers, '0', '0')
  head = type(head) == 'table' and head[1]
  if type(head) ~= 'string' then return end
  local info = call('HGET', info_key, head)
  if type(info) ~= 'string' then return end
  local n = taker_info(info)
  if n and tonumber(count or redis.call('HGET', state, 'count')) >= n then
    if type(call('RPUSH', wake, '1')) == 'number' then
      redis.call('LTRIM', wake, '-1', '-1')
    end
  end
end

-- Exact int64 arithmetic on decimal strings (Lua numbers are doubles, exact only to 2^53).
local INT64_MAX, INT64_MIN = '9223372036854775807', '-9223372036854775808'

-- -1, 0 or 1 as a < b, a == b, a > b, for canonical decimal integers (no '+', no leading 0).
local function int_cmp(a, b)
  local na, nb = string.sub(a, 1, 1) == '-', string.sub(b, 1, 1) == '-'
  if na ~= nb then return na and -1 or 1 end
  local sign = na and -1 or 1
  if #a ~= #b then return (#a < #b and -1 or 1) * sign end
  if a == b then return 0 end
  return (a < b and -1 or 1) * sign
end

-- A canonical decimal integer within int64 (what the client sends for steps).
local function is_int64(s)
  if type(s) ~= 'string' or not (s == '0' or string.find(s, '^%-?[1-9]%d*$')) then return false end
  return #s <= 20 and int_cmp(s, INT64_MIN) >= 0 and int_cmp(s, INT64_MAX) <= 0
end

-- A non-negative decimal count (sequence numbers, sizes, milliseconds), canonical: no leading
-- zero (Redis refuses "0100" where a script passes it on, e.g. as an expiry, after a write).
local function is_count(s)
  return type(s) == 'string' and #s <= 18 and (s == '0' or string.find(s, '^[1-9]%d*$') ~= nil)
end

-- The state fields that hold integers, and what an unset one means (absent here: it must be
-- set). A value written by another program (not a number, or '' ) would fail a script after
-- its first write, where arithmetic or HINCRBY meets it: read_state refuses it before.
local STATE_INTS = {step = false, count = false, gen = false, bytes = false, ttl = '0',
  n_taken = '0', grads_taken = '0', n_applied = '0', maxbytes = false, sealed = false}
local STATE_OPTIONAL = {maxbytes = true, sealed = true}
-- What the state field 'sum' may hold: a dtype the accsum module adds (accumulator/_module.py).
local SUM_DTYPES = {f32 = true, f64 = true, i8 = true, u8 = true, i16 = true, u16 = true,
  i32 = true, u32 = true, i64 = true, u64 = true}

-- One HMGET for the schema check, the instance check (`inst`: the id the caller's object
-- opened; nil or '': none) and the fields a script needs (a call per field costs more than the
-- work). Returns an error reply, or nil and a table field -> value (false if unset; the
-- default of STATE_INTS for an unset counter). Integer fields are checked: BADSTATE when one
-- is not (ttl: any non-negative number, as older versions wrote it).
local function read_state(state, want, fields, inst)
  local values = redis.pcall('HMGET', state, 'schema', 'inst', unpack(fields))
  if values.err then return probe_error('HMGET', state, 'hash', values.err) end
  if not values[1] then return acc_error('NOTFOUND') end
  if values[1] ~= want then return acc_error('SCHEMA ' .. values[1]) end
  local err = check_inst(values[2], inst)
  if err then return err end
  local out = {}
  for i, name in ipairs(fields) do
    local value, default = values[i + 2], STATE_INTS[name]
    if default ~= nil then
      if not value then
        value = default
        if not value and not STATE_OPTIONAL[name] then
          return acc_error('BADSTATE the state field ' .. name .. ' is missing')
        end
      end
      local ok
      if name == 'ttl' then
        local ms = tonumber(value)
        ok = ms ~= nil and ms >= 0 and ms < 2^53
      elseif name == 'step' or name == 'sealed' then
        ok = is_int64(value)
      else
        ok = is_count(value)
      end
      if value and not ok then
        return acc_error('BADSTATE the state field ' .. name .. ' holds ' ..
          string.format('%q', string.sub(value, 1, 40)) .. ', not a number it can hold')
      end
    end
    if name == 'sum' and value and not SUM_DTYPES[value] then
      return acc_error('BADSTATE the state field sum holds ' ..
        string.format('%q', string.sub(value, 1, 40)) .. ', not a dtype the accsum module adds')
    end
    out[name] = value
  end
  return nil, out
end

-- The base of an accumulator's state key, '<base>:s' with base '<prefix>:{<tag>}' (braces in
-- the tag are escaped: accumulator/_keys.py, hash_tag), or nil: no other key is one.
local function state_base(state)
  if type(state) ~= 'string' or not string.find(state, '^[^{}]+:{[^{}]*}:s$') then return nil end
  return string.sub(state, 1, -3)
end

-- Every key a script touches is one of its own accumulator's: KEYS[1] is '<base>:s' and each
-- other key must be '<base>' .. the given suffix. Returns the base, or nil and an error reply.
local function own_keys(suffixes)
  local base = state_base(KEYS[1])
  if not base then return nil, acc_error('BADKEY 1') end
  for i, suffix in ipairs(suffixes) do
    if suffix ~= '' and KEYS[i + 1] ~= base .. suffix then return nil, acc_error('BADKEY ' .. (i + 1)) end
  end
  return base
end

-- A key under '<base>:<kind>:' followed by exactly what the library puts there: blob keys
-- ('b') are '<client id hex>:<seq>', claim keys ('c') '<pid>-<hex>', dedup keys ('d') hex,
-- payload parts ('p', under ':b:' too) '<client id hex>:<seq>:<part>'.
local KEY_TAILS = {b = '^%x+:%d+$', c = '^%d+%-%x+$', d = '^%x+$', p = '^%x+:%d+:%d+$'}
local function is_own(base, key, kind)
  local head = base .. ':' .. (kind == 'p' and 'b' or kind) .. ':'
  return string.sub(key, 1, #head) == head and string.find(key, KEY_TAILS[kind], #head + 1) ~= nil
end

-- The blob key of apply `seq` of the client whose retry record is `dedup` (both checked by
-- is_own): '<base>:b:<client id>:<seq>'. An apply or a withdraw names its own payload only, so
-- a refusal, which drops that payload, can never drop another apply's.
local function apply_blob(base, dedup, seq)
  return base .. ':b:' .. string.sub(dedup, #base + 4) .. ':' .. seq
end

-- Large payloads are stored in parts of CHUNK bytes (the last one shorter), never one value:
-- no command moves more than a chunk. accumulator/_chunks.py has the same number.
local CHUNK = 1044480  -- 1 MiB - 4 KiB: why, see _chunks.py
-- A payload of up to SOLE bytes is one part (of its length: 1 MiB gradients stay one value).
local SOLE = 1048576

-- How many parts a payload of nbytes is stored in.
local function n_parts(nbytes)
  if nbytes <= SOLE then return 1 end
  return math.ceil(nbytes / CHUNK)
end

-- A claim's lease, in ms from now: the base (take's ARGV), plus time per MiB (reading) and per
-- entry (merging: a sparse round of 300,000 one-row gradients is 7 MB but took 7-8 s to merge,
-- past a lease sized by bytes alone, and two takers took it from each other forever: sparse
-- review). take.lua sets it at the claim, renew.lua again while the taker reads.
local LEASE_MS_PER_ENTRY = 0.2
local function claim_lease_ms(base_ms, per_mib, nbytes, entries)
  return tonumber(base_ms) + math.floor(tonumber(nbytes) / 1048576 * tonumber(per_mib)
    + entries * LEASE_MS_PER_ENTRY)
end

-- Payloads a script dropped (reset.lua) expire this long after, should the client that is to
-- unlink them right away be cut short.
local DROPPED_TTL_MS = 60000

-- How long a finished take is remembered (finish.lua), to answer a retried finish.
local FINISH_MEMORY_MS = 120000
local MAX_PARTS = 1048576

-- How many parts of a large gradient the accsum module path adds into the round's sum per
-- script (apply.lua, then fold.lua): ~8 MiB of adds, a few ms of Redis's thread each, so
-- other clients are served between them. accumulator/_chunks.py has the same number.
local FOLD = 8

-- A spread entry, 'd' .. n .. ' ' .. blob key: a payload in n parts spread over other slots
-- (accumulator/_keys.py, Keys.spread_part), which the client writes, checks and reads; scripts
-- only record the entry. n, or nil when the entry is not one of this accumulator's.
local function spread_parts(base, entry)
  local n, blob = string.match(entry, '^d([1-9]%d?%d?%d?%d?%d?%d?) (.+)$')
  n = tonumber(n)
  if not n or n > MAX_PARTS or not is_own(base, blob, 'b') then return nil end
  return n
end

-- How long a client that dropped, took or swept spread payloads holds them to delete their
-- parts, before any other sweeper may (orphans.lua). accumulator/_model.py has the same.
local SWEEP_LEASE_MS = 60000

-- The spread entries among `entries` become garbage in the orphans zset: a sweeper deletes
-- their parts from `due` ms on (the caller's own lease, or now: anyone's). Returns them.
local function discard_spread(base, orphans, entries, due)
  local out = {}
  for _, entry in ipairs(entries) do
    if string.sub(entry, 1, 1) == 'd' and spread_parts(base, entry) then
      redis.call('ZADD', orphans, int_str(due), 'x' .. entry)
      out[#out + 1] = 'x' .. entry
    end
  end
  return out
end

-- The payload keys a round entry names, or nil and why not. Entries: 'i' .. payload (inline,
-- no key), 'k' .. blob key (one key), 'p' .. n .. ' ' .. blob key (parts blob:0 .. blob:n-1),
-- 's' .. w .. ' ' .. n .. ' ' .. blob key: the running sum of w gradients, kept in Redis by
-- the accsum module (parts as for 'p'), 'f' .. k .. ' ' .. n .. ' ' .. blob key: a gradient
-- being folded into that sum: its parts 0 .. k-1 are in the sum already (and freed), parts
-- blob:k .. blob:n-1 are still its own (0 < k < n).
-- 'd' .. n .. ' ' .. blob key: spread over other slots (see spread_parts): no keys here.
-- Only this accumulator's own payload keys are ever named: anything else is 'foreign'.
local function entry_keys(base, entry)
  local kind = string.sub(entry, 1, 1)
  if kind == 'i' then return {} end
  if kind == 'd' then  -- none in this slot
    if spread_parts(base, entry) then return {} end
    return nil, 'foreign'
  end
  if kind == 'k' then
    local key = string.sub(entry, 2)
    if is_own(base, key, 'b') then return {key} end
    return nil, 'foreign'
  end
  if kind == 'p' or kind == 's' or kind == 'f' then
    local n, blob, first = nil, nil, 0
    if kind == 'p' then
      n, blob = string.match(entry, '^p([1-9]%d?%d?%d?%d?%d?%d?) (.+)$')
    elseif kind == 's' then
      n, blob = string.match(entry, '^s[1-9]%d?%d?%d?%d?%d?%d?%d?%d? ([1-9]%d?%d?%d?%d?%d?%d?) (.+)$')
    else
      first, n, blob = string.match(entry, '^f([1-9]%d?%d?%d?%d?%d?%d?) ([1-9]%d?%d?%d?%d?%d?%d?) (.+)$')
      first = tonumber(first)
    end
    n = tonumber(n)
    if not n or n > MAX_PARTS or not is_own(base, blob, 'b') then return nil, 'foreign' end
    if not first or first >= n then return nil, 'foreign' end
    local keys = {}
    for i = first, n - 1 do keys[#keys + 1] = blob .. ':' .. i end
    return keys
  end
  return nil, 'foreign'
end

-- The first part an entry still holds itself (k of an 'f' entry; 0 otherwise).
local function entry_first_part(entry)
  if string.sub(entry, 1, 1) ~= 'f' then return 0 end
  return tonumber(string.match(entry, '^f(%d+) ')) or 0
end

-- How many gradients an entry holds (a running sum holds several).
local function entry_weight(entry)
  if string.sub(entry, 1, 1) ~= 's' then return 1 end
  return tonumber(string.match(entry, '^s(%d+) ')) or 1
end

-- The round's running sum (its first entry, 's<w> <n> <blob>') now holds one more gradient.
local function count_in_sum(grads, sum)
  redis.call('LSET', grads, '0', 's' .. int_str(entry_weight(sum) + 1) .. ' ' ..
    string.match(sum, '^s%d+ (.+)$'))
end

-- Whether a client's retry record (`prev`: its dedup key's value, '<seq>' or '<seq> <result>';
-- false when there is none) is at apply `seq` or later: that apply, or a later one of the
-- client, has run (a copy of it arriving now is a late one).
local function record_reached(prev, seq)
  local pseq = type(prev) == 'string' and string.match(prev, '^(%d+)') or nil
  return pseq ~= nil and is_count(pseq) and int_cmp(seq, pseq) <= 0
end

-- Whether list `list` (a round, or a claim) has an entry naming payload `blob`: `entry`
-- itself (LPOS, scanned in C: a round of inline payloads is not read into Lua), else, read,
-- one of another form ('s'/'f' entries of the module's running sum, 'k' ones of old clients).
-- nil when it cannot tell (refused by the ACL, a value of another type).
local function list_names(list, entry, blob)
  local at = redis.pcall('LPOS', list, entry)
  if type(at) == 'number' then return true end
  local entries = redis.pcall('LRANGE', list, 0, -1)
  if entries.err then return nil end
  for _, e in ipairs(entries) do
    if string.sub(e, 1, 1) ~= 'i' and (e == 'k' .. blob or string.sub(e, -#blob - 1) == ' ' .. blob) then
      return true
    end
  end
  return false
end

-- Whether a round holds payload `blob` (round entry `entry`): the pending round (list `grads`)
-- or a round a taker claimed and is reading (a claim list of the claim registry `claims`).
-- A late copy of an apply (apply.lua) must not drop the payload the apply it copies was
-- accepted with, nor a withdraw one whose retry record expired. True too when it cannot tell.
local function round_holds(base, grads, claims, entry, blob)
  local lists = {grads}
  local registry = redis.pcall('HGETALL', claims)
  if registry.err then return true end
  for i = 1, #registry, 2 do
    local claim = base .. ':c:' .. registry[i]
    if is_own(base, claim, 'c') then lists[#lists + 1] = claim end
  end
  for _, list in ipairs(lists) do
    local named = list_names(list, entry, blob)
    if named ~= false then return true end
  end
  return false
end

-- UNLINK any number of keys (Lua's unpack stops at a few thousand values).
local function unlink_all(keys)  -- returns how many existed
  local deleted = 0
  for i = 1, #keys, 1000 do
    deleted = deleted + redis.call('UNLINK', unpack(keys, i, math.min(i + 999, #keys)))
  end
  return deleted
end

-- dst[doff + j] += src[j] for j = 1 .. m, in place (the accsum module, dtype its name), then
-- src's parts are freed: parts of a gradient added into a round's running sum.
local function add_parts(dst, doff, src, m, dtype)
  local done = {}
  for j = 1, m do
    redis.call('ACC.ADD', dst[doff + j], src[j], dtype)
    done[j] = src[j]
  end
  unlink_all(done)
end

-- The payload length of an entry whose keys are `keys` (from entry_keys), or nil and why not:
-- every part but the last exactly CHUNK bytes, the last at most CHUNK (SOLE when it is the only
-- one), none empty or missing. For an 'f' entry, the
-- length of the parts it still holds.
local function entry_length(entry, keys)
  local kind = string.sub(entry, 1, 1)
  if kind == 'i' then return #entry - 1 end
  if kind == 'k' then
    local len = redis.pcall('STRLEN', keys[1])
    if type(len) ~= 'number' then return nil, 'not a string' end
    if len == 0 then return nil, 'missing' end
    return len
  end
  local total, first = 0, entry_first_part(entry)
  for i, key in ipairs(keys) do
    -- (pcall: a payload overwritten with another type is quarantined like a resized one)
    local len = redis.pcall('STRLEN', key)
    if type(len) ~= 'number' then return nil, 'part ' .. (first + i - 1) .. ' not a string' end
    if len == 0 then return nil, 'missing' end
    if len > (#keys == 1 and SOLE or CHUNK) or (i < #keys and len ~= CHUNK) then
      return nil, 'part ' .. (first + i - 1) .. ' length ' .. len
    end
    total = total + len
  end
  return total
end

-- Type checks before the first write: a key of ours holding a value of another type (a
-- foreign write in the accumulator's namespace) would fail a script half-way. checks = {key,
-- type, key, type, ...}; a missing key is fine. Each key is probed with a read of its type
-- that moves nothing (not TYPE: the roles in the README's Security section, and deployments
-- made from them, do not grant it). nil, or the BADTYPE error reply.
local TYPE_PROBES = {list = {'LRANGE', '1', '0'}, zset = {'ZCARD'}, hash = {'HGET', ''},
  string = {'STRLEN'}}
local function check_types(checks)
  for i = 1, #checks, 2 do
    local key, probe = checks[i], TYPE_PROBES[checks[i + 1]]
    local r = redis.pcall(probe[1], key, unpack(probe, 2))
    if type(r) == 'table' and r.err then return probe_error(probe[1], key, checks[i + 1], r.err) end
  end
  return nil
end

-- Permission checks before the first write: a script that fails half-way leaves its earlier
-- writes in place (Redis scripts do not roll back). checks = {command, key or channel (false:
-- none), command, key, ...}: one table, not one per check (tables cost Redis's thread).
-- Servers without redis.acl_check_cmd (before 7.0, fakeredis) have no ACL selectors to fear.
local function check_acl(checks)
  local allowed = redis.acl_check_cmd
  if not allowed then return nil end
  for i = 1, #checks, 2 do
    local command, key = checks[i], checks[i + 1]
    local ok
    if command == 'PUBLISH' then ok = allowed('PUBLISH', key, '1')
    elseif not key then ok = allowed(command)
    else ok = allowed(command, key) end
    if not ok then return acc_error('NOPERM ' .. command .. ' ' .. (key or '-')) end
  end
  return nil
end

