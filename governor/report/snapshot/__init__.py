"""The read side's one look at the governor: its parts read once into frozen values.

`stats` (`Snapshot.to_dict`, through `ServerState.snapshot`), the Prometheus collector
(report/metrics.py) and so `governor status` (report/status.py renders two `stats` replies) all
read a `Snapshot`: each number is derived from the live objects here and nowhere else. The values
are raw; the `stats` form rounds some of them, Prometheus takes them as they are.

    reading.py   `read`: the whole governor, through what it reads of the state (`Wiring`)
    parts.py     the readings of admission's and accounting's parts: load and caps, token cost,
                 deadlines, the adaptive limit, the retry hints, tenants and classes, histograms
    fleet.py     this replica's lease on the fleet caps

Its own layer, below the state that reads it for `stats`. May import: govwire, admission/,
accounting.py, latency.py and fleet/ (the member as a type only: reading the state must not
import the Redis client). Never the state (it reads it through `Wiring`), the links, the doors or
the rest of report/.
"""
