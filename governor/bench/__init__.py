"""`governor bench`: a streaming benchmark client for a running governor (or, with --direct, a worker).

`config` declares the flags; `schedule` decides when each request is submitted and `stats` turns
per-request client timestamps into the reported figures (both pure, unit-tested without
sockets); `runner` drives the connections; `report` and `plot` present a run; `main` ties them
together and is what the experiment scripts in benchmarks/ call.
"""
