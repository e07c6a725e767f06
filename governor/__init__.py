"""governor: a TCP ingress governor for inference workers (the server, its clients and its bench).

The wire contract it shares with the worker lives in the `govwire` package.
"""

__version__ = "0.1.0"
