"""governor: a TCP ingress governor for inference workers (the server, its clients and its bench).

The path of a frame through the folders:

    doors/         a client's bytes → frames (NDJSON port, OpenAI-compatible HTTP) → replies
    admission/     one decision over every limit: admitted (a Grant) or refused (a yield)
    lifecycle.py   an admitted request's phases, and every way it ends
    links/         the endpoints that run it: worker processes, OpenAI-compatible servers
    fleet/         caps shared with other replicas: a lease (one more limit) renewed in Redis

Beside them: `accounting.py` (every count), `latency.py` (the histograms), `timers.py` (where
deadlines are set), `state.py` (what every connection shares), `report/` (the read side: one
snapshot that `stats`, Prometheus and the status page read) and `shell/`, which reads the
configuration, builds and runs it all, and spawns and restarts the workers. Nothing imports the
shell. `client/` and `bench/` talk to a governor through its socket. The wire contract it shares
with the worker lives in the `govwire` package; tests/unit/test_layers.py checks who imports whom.
"""

from govwire import __version__

__all__ = ["__version__"]
