"""The inference worker process: engines behind an NDJSON socket server."""
