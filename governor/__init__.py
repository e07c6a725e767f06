"""governor: a TCP ingress governor for inference workers.

Kept import-free so `import governor.wire` (used by the worker and by clients) pulls in
neither uvloop nor prometheus-client.
"""

__version__ = "0.1.0"
