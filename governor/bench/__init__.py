"""`governor bench`: a streaming benchmark client for a running governor (or, with --direct, a worker).

`config` declares the flags; `schedule` decides when each request is submitted, `tenants` which
tenant and class it speaks for, and `stats` turns per-request client timestamps into the reported
figures (all pure, unit-tested without sockets); `runner` drives the connections; `report` and
`plot` present a run (overall and per --tenant-mix group); `main` ties them together and is what
the experiment scripts in benchmarks/ call.
"""
