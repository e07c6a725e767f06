"""Admission: one decision over a set of limits, answered at once for every generate frame.

`decision.py` decides (check all, then charge all, or refuse with the refusing limit's reason and
retry hint; a displacement is answered as data, `Displace`, for the lifecycle to carry out), from
the parts `build.py` makes once; `limits.py` says what a limit is (and how one reports its room)
and holds the limits on a request as a whole; `caps.py` is the six caps every scope declares;
`reasons.py` what each refusal reason means here. The rest are limits and what they reason with:
the endpoint pool and its endpoints (`pool.py`, `endpoint.py`), token cost (`cost.py`), rate
buckets (`buckets.py`), retry hints (`hints.py`) and the release forecast they are drawn from
(`release_forecast.py`), the appointments that make a hint a promise and the lobby that holds
returning clients (`appointments/`), deadlines and the TTFT model (`deadline.py`, `ttft.py`), the
adaptive limit (`adaptive_limit.py`), tenants, their caps, their fair shares and their counts
(`tenant.py`, `tenant_caps.py`, `fair_share.py`, `tally.py`), the priority classes
(`priority.py`) and displacement before the first token (`displacement.py`).

Pure: no sockets and no clock of its own (`now` is passed in). May import: govwire, latency.py
(the histograms) and timers.py (where the lobby sets its deadlines), nothing above it.
"""
