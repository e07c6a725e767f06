"""Admission: one decision over a set of limits, answered at once for every generate frame.

`decision.py` owns every limit and decides (check all, then charge all, or refuse with the
refusing limit's reason and retry hint); `limits.py` says what a limit is and holds the limits
on a request as a whole. The rest are limits and what they reason with: the endpoint pool and
its endpoints (`pool.py`, `endpoint.py`), token cost (`cost.py`), rate buckets (`buckets.py`),
retry hints (`hints.py`), deadlines and the TTFT model (`deadline.py`, `ttft.py`), the adaptive
limit (`adaptive_limit.py`), tenants, their caps, their fair shares and their counts (`tenant.py`,
`tenant_caps.py`, `fair_share.py`, `tally.py`) and the priority classes (`priority.py`).

Pure: no sockets and no clock of its own (`now` is passed in). May import govwire and
governor/latency.py (the histograms, which import nothing) only: nothing above it.
"""
