"""The read side: what the governor tells about itself.

`metrics.py` (the Prometheus families), `metrics_server.py` (the HTTP endpoint that serves
them) and `status.py` (the `governor status` page, rendered from a `stats` reply).

May import: the layers below (state.py, lifecycle.py, links/, fleet/, admission/, accounting.py,
latency.py). Never the doors or the shell; nothing below imports it.
"""
