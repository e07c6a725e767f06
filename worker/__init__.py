"""The inference worker process: a backend (GPT-2 engine or echo) behind an NDJSON socket server."""
