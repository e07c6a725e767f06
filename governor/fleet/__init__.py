"""Fleet caps, shared by governor replicas through Redis.

`lease.py` is this replica's lease on the fleet's caps: one admission limit, enforced locally, and
the state machine of its renewals (sans-IO, the clock passed in); `shares.py` is its share of each
cap and the demand it measures for the next renewal; `lease.lua` is the allocation Redis runs
atomically at each renewal; `member.py` is the only I/O: the renewals, through redis-py;
`redis_url.py` reads the --fleet URL.

Each replica of a fleet holds a *lease*: a share of every fleet limit (`--fleet-max-inflight`
slots, `--fleet-max-qps` admissions per second, `--fleet-max-inflight-tokens` tokens held,
`--fleet-max-tokens-per-s` tokens per second). Admission checks the local share in the read
callback like any other limit, with no network round trip; member.py renews the lease every
`renew_s` by running lease.lua atomically in Redis. That script is the whole allocation:

- **Wants.** Each renewal reports, per limit, what the replica holds now (`usage`), what it
  wants (for a held limit what it holds plus what waited for it on average over the period; for
  a rate, what it admitted per second plus what waited, to be served within a period) and the
  share it applies until the reply reaches it (`applied`).
- **Targets follow demand.** When the fleet's wants exceed the limit, each replica's target is
  its proportional part (every request has the same chance whichever replica it reached, as
  behind one governor); otherwise its want plus a little headroom for a burst (an equal part of
  what is left, at most 5% of the limit, at least one request), the rest staying free for
  whichever replica's demand grows: it takes it at its next renewal.
- **Grants never sum over the limit.** A replica's new share is its target capped by what the
  others hold. What Redis keeps reserved for it (`held`) is the largest of its new share, the
  share it applies until the reply arrives and (for held limits) its usage: a shrinking share is
  freed only once the replica has applied it, which it reports at once in a confirming renewal.
  So the shares in force at any instant sum to at most the limit, and so does the fleet's usage.
- **Leases expire, reservations outlast them.** Each entry carries an expiry `lease_s` after the
  renewal. Locally, the lease counts from the moment the renewal was *sent* (before Redis
  stamped it), so it lapses here no later than Redis's expiry. Redis cannot tell a dead replica
  from one cut off from it that still serves, so what an entry holds stays reserved after its
  expiry for as long as the replica may still use it: `hold_s` more while its fallback may
  still admit within its last share, then `max_request_s` more for a held resource, by which time
  the replica has cancelled whatever still runs (`cut_at`); and half a lease more, what a step of
  Redis's clock may advance the fleet's clock in one renewal (lease.lua). Only then does the
  script drop the entry and hand its capacity to the others. A new hash grows no share for a
  lease, nor, for a lease and a half, one a replica's renewal shows Redis lost writes of (its
  entry older than the last renewal it applied): until every live replica has reported what it
  holds. So the fleet
  stays under its limits through a partition of any length; the price is that a dead replica's
  share comes back after lease x 1.5 + hold + max request instead of the lease alone (a replica
  that stops cleanly deletes its entry at once).
- **Fallbacks** (`--fleet-unavailable`), once no renewal succeeded for `lease_s`: `hold` keeps
  admitting within the last shares for `hold_s`, then closes; `closed` admits nothing;
  `local` enforces the limit divided by the last known replica count for as long as the lapse
  lasts — unreserved, so the fleet may exceed its limits while another replica still reaches
  Redis: an explicit opt-in for availability over the cap, and the entry keeps no reservation. The
  next successful renewal rejoins, within the reservation it kept: no burst over the limits.
- **Rates.** A replica's rate share runs its own token bucket whose burst is the same fraction of
  the fleet burst; a new bucket starts empty, an existing one keeps what it holds (never above the
  new burst), so the fleet admits at most burst + limit x T over any window of T seconds. A share
  whose burst is under one request admits nothing until it grows.

Appointments: the in-flight share's refusals are booked (build.fleet_book), the k-th refused
promised the k-th slot nobody was promised yet: the fleet's free slots (this replica's part of
them) for the reply of the renewal that will grow its share, then this replica's releases,
counted against the share the fleet's demand gives it when that is smaller. A renewal reports
its promises as wanted, and what it holds plus the appointments due within two periods as
`kept`: the script never shrinks the share below that, up to what it applies (reserved already).
Promises are made while no other replica's clients wait: under contention every renewal moves
every share, and the share hints without booking.

Hints of what is not booked: the in-flight share under contention, the replica's release
timeline scaled to the share; the token share, the time what this replica holds takes to drain
enough (hints.DrainHint); with `--retry-hint fixed` (no book), both held shares the base value. A
rate, the bucket's exact refill; with nothing held or no lease, the next renewal (exact waits, in
either mode). What the hints told clients to wait is also how each replica measures its waiting
demand (shares.py).

May import: govwire, admission/ and latency.py. Admission knows the lease only as a
`SharedLimit` (admission/limits.py).
"""
