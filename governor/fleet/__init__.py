"""Fleet caps, shared by governor replicas through Redis.

`lease.py` is this replica's lease on the fleet's caps, enforced locally as one admission limit
(sans-IO, the clock passed in); `lease.lua` is the allocation Redis runs atomically at each
renewal; `member.py` is the only I/O: the renewals, through redis-py.

May import: govwire, admission/ and latency.py. Admission knows the lease only as a
`SharedLimit` (admission/limits.py).
"""
