"""The read side: what the governor tells about itself.

`snapshot/` (the governor's parts read once into frozen values: what `stats`, /metrics and
`governor status` all show), `metrics.py` and `link_metrics.py` (the Prometheus families: the
governor's from a snapshot, the links' from the links), `metrics_server.py` (the HTTP endpoint
that serves them) and `status.py` (the `governor status` page, rendered from two `stats` replies).

May import: govwire and the layers below (state.py, lifecycle.py, links/, fleet/, admission/, accounting.py,
latency.py). Never the doors or the shell; nothing below imports it, except `snapshot/`: its own
layer below the state (which reads it for `stats`), see its docstring.
"""
