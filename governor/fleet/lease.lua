-- One replica's lease renewal, run atomically inside Redis (EVALSHA): the whole fleet-wide
-- allocation, so no two replicas ever decide on the same free capacity. The rules are in
-- governor/fleet/__init__.py's docstring and docs/operations.md ("Fleet").
--
-- KEYS[1]  the fleet's hash: one field per replica, "EXPIRY_MS HOLD_MS RELEASE_MS SEQ" (absolute,
--          in the fleet's clock; the renewal that wrote it) then, per resource, "LIMIT WANT HELD
--          USAGE" (space-separated numbers).
--          Before EXPIRY the replica is live; until HOLD what it held stays reserved (a lapsed
--          replica may still admit within its last share); until RELEASE a held resource stays
--          reserved (its requests may still run); then the entry is dropped. HOLD and RELEASE
--          include half a lease more than the replica counts on (the fleet clock's `step`). And the field
--          "~clock": "TIME_MS FLEET_MS FROZEN_MS", the fleet's clock (below) as of the last
--          renewal, and until when in it no share grows.
-- ARGV     member id, renewal number (rising: a renewal the replica gave up on that reaches Redis
--          after a later one changes nothing), the number of the last renewal whose reply it
--          applied (0 if none), lease TTL (ms), hold (ms after the expiry), release (ms after
--          the hold), resource count k, then per resource seven numbers: limit (0 = not limited), usage (what
--          it holds now: requests or tokens; 0 for rates), want (its demand), applied (the share
--          it enforces until this reply reaches it), held (1 for a held resource whose grants are
--          whole numbers, 0 for a rate), least (the smallest useful share: one request; a replica
--          that wants any gets at least this much while it is free, or a proportional part under
--          1 would starve it), kept (for a held resource: what it holds and the appointments due
--          soon that its refusals promised under the share it applies count on; its new share is
--          never less, up to what it applies, which is reserved for it already).
-- Returns  {-1} for a renewal older than the last one run (the replica gave up on it), else
--          the live replica count, its renewal number, the lapsed replicas whose reservations stand, then per
--          resource six strings (Lua numbers would be truncated to integers on the way out): its
--          new share, the fleet limit in force, the fleet's usage, the sum of the fleet's wants,
--          its target (more than its share while the others still hold what it is owed), and
--          what the others keep reserved (live or lapsed).
local HEADROOM = 0.05
local key, me, seq, applied_seq = KEYS[1], ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local ttl, hold, release, k = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local entries = redis.call('HGETALL', key)
local stored_seq = 0
for i = 1, #entries, 2 do
  if entries[i] == me then
    stored_seq = tonumber(string.match(entries[i + 1], '^%S+ %S+ %S+ (%S+)')) or 0
    if stored_seq >= seq then
      return { -1 }
    end
  end
end

-- The fleet's clock, in which every expiry is written: Redis's TIME, but advancing by at most
-- `step` (half a lease) between two renewals and never backwards, so that a step of Redis's wall
-- clock (or a failover to a host whose clock differs) can neither expire the live entries (each
-- renewed at least every half lease) nor freeze them. A gap of more than a lease since the last
-- renewal is no time the fleet can have seen pass (its live replicas renew every half lease): a
-- step of the clock, or a silence of the whole fleet, and it advances the clock by nothing. Were
-- it to count for `step`, every step of the wall clock would, and the reservation of a replica
-- cut off through several of them would end before its cut (a lapsed replica's reservation lasts
-- one `step` longer than the replica counts on: a step of the clock by less than a lease, or
-- a renewal late past the half lease, moves the clock at most that far ahead). A real silence only delays
-- expiries: safe.
local clock = redis.call('TIME')
local time = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local step = math.floor(ttl / 2)
local now, frozen_until = time, nil
for i = 1, #entries, 2 do
  if entries[i] == '~clock' then
    local last_time, last, until_ = string.match(entries[i + 1], '^(%S+) (%S+) ?(%S*)')
    if last then
      local gap = time - tonumber(last_time)
      if gap < 0 or gap > ttl then gap = 0 end
      now = tonumber(last) + math.min(gap, step)
      frozen_until = tonumber(until_) or now
    end
  end
end
-- A hash just (re)created — a new fleet, or a Redis that lost it (restarted empty, flushed,
-- evicted) — knows nothing of what the replicas hold: until every live one has renewed (a
-- lease), no share grows past what its replica already applies or holds. A replica whose entry
-- is older than the last renewal it applied proves that Redis lost writes (the hash, a failover
-- without the replicas' acknowledgement, a restore from a snapshot): the same freeze, from now,
-- and a step longer (the clock may have jumped with the data). What Redis lost of a replica cut
-- off at the time — its reservation — it cannot know: docs/operations.md says so.
frozen_until = frozen_until or now + ttl
if stored_seq < applied_seq then
  frozen_until = math.max(frozen_until, now + ttl + step)
end
local frozen = now < frozen_until

local limit, usage, want, applied, whole, least, kept = {}, {}, {}, {}, {}, {}, {}
local wants, others_held, usages = {}, {}, {}
for r = 1, k do
  local at = 7 + (r - 1) * 7
  limit[r] = tonumber(ARGV[at + 1])
  usage[r] = tonumber(ARGV[at + 2])
  want[r] = tonumber(ARGV[at + 3])
  applied[r] = tonumber(ARGV[at + 4])
  whole[r] = ARGV[at + 5] == '1'
  least[r] = tonumber(ARGV[at + 6])
  kept[r] = tonumber(ARGV[at + 7])
  wants[r], others_held[r], usages[r] = want[r], 0, usage[r]
end

-- The other replicas: drop those whose reservations have all ended; sum what the live ones want
-- and use, and what every one still keeps reserved. The tightest limit any live one reports is
-- the one in force (a rolling change of the limits stays safe).
local replicas, lapsed, last = 1, 0, now + ttl + step + hold + release
for i = 1, #entries, 2 do
  local field = entries[i]
  if field ~= me and field ~= '~clock' then
    local v, unreadable = {}, false
    for x in string.gmatch(entries[i + 1], '%S+') do
      local n = tonumber(x)
      if n == nil then unreadable = true end
      v[#v + 1] = n or 0
    end
    if unreadable or #v < 4 or v[3] <= now then  -- reservations over (or an entry it cannot read)
      redis.call('HDEL', key, field)
    else
      local live = now < v[1]
      if live then replicas = replicas + 1 else lapsed = lapsed + 1 end
      if v[3] > last then last = v[3] end
      for r = 1, k do
        local at = 4 + (r - 1) * 4
        if live then
          local l = v[at + 1] or 0
          if limit[r] > 0 and l > 0 and l < limit[r] then limit[r] = l end
          wants[r] = wants[r] + (v[at + 2] or 0)
        end
        if live or now < v[2] or whole[r] then  -- a held resource stays reserved until RELEASE
          others_held[r] = others_held[r] + (v[at + 3] or 0)
          usages[r] = usages[r] + (v[at + 4] or 0)
        end
      end
    end
  end
end

local stored = {
  tostring(now + ttl), tostring(now + ttl + step + hold), tostring(now + ttl + step + hold + release), ARGV[2]
}
local reply = { replicas, seq, lapsed }
for r = 1, k do
  local share, held, target = 0, 0, 0
  local l = limit[r]
  if l > 0 then
    -- Demand-following target: in proportion to the wants when they exceed the limit, else each
    -- replica's want plus headroom for a burst: an equal part of what is left, at most 5% of the
    -- limit (at least one request); the rest stays free for whichever replica asks for it.
    if wants[r] >= l then
      target = l * want[r] / wants[r]
    else
      target = want[r] + math.min((l - wants[r]) / replicas, math.max(least[r], l * HEADROOM))
    end
    if whole[r] then target = math.floor(target + 0.5) end  -- to the nearest: floors would leave slots unused
    if want[r] > 0 and target < least[r] then target = least[r] end
    -- Never more than what the others do not hold: the grants never sum over the limit.
    local free = l - others_held[r]
    if whole[r] then free = math.floor(free) end
    share = math.min(target, free)
    if frozen then share = math.min(share, math.max(applied[r], whole[r] and usage[r] or 0)) end
    -- A promise made under the share it applies survives the renewal: no smaller than what its
    -- appointments due soon count on. Within what it applies (reserved for it already, so the
    -- grants still never sum over the limit) and what the others leave free.
    if whole[r] then share = math.max(share, math.min(kept[r], applied[r], free)) end
    if share < 0 then share = 0 end
    -- Still reserved for this replica: what it enforces until the reply reaches it, and, for a
    -- held resource, what it holds now (requests admitted under an earlier, larger share).
    held = math.max(share, applied[r])
    if whole[r] then held = math.max(held, usage[r]) end
  end
  stored[#stored + 1] = tostring(l)
  stored[#stored + 1] = tostring(want[r])
  stored[#stored + 1] = tostring(held)
  stored[#stored + 1] = tostring(usage[r])
  reply[#reply + 1] = tostring(share)
  reply[#reply + 1] = tostring(l)
  reply[#reply + 1] = tostring(usages[r])
  reply[#reply + 1] = tostring(wants[r])
  reply[#reply + 1] = tostring(target)
  reply[#reply + 1] = tostring(others_held[r])
end
redis.call('HSET', key, me, table.concat(stored, ' '), '~clock', string.format('%d %d %d', time, now, frozen_until))
-- The key's own TTL is on Redis's wall clock (a step ahead past it would drop every
-- reservation at once): a day past the last one, only to clean up after a fleet that is gone.
redis.call('PEXPIRE', key, last - now + 86400000)
return reply
