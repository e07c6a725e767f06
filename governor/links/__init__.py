"""The links: from the governor to the endpoints that run admitted requests.

`upstream.py` holds a link per endpoint and dispatches each admitted request to the endpoint
admission chose; `worker_link.py` speaks NDJSON to a worker process, `openai_link.py` HTTP to an
OpenAI-compatible server (with the mapping of `openai_stream.py`, each response read by an
`openai_relay.py` relay, over the pooled connections of `http_client.py` and the event stream
of `sse.py`, and measured as it comes up by `endpoint_probe.py`); `health.py` is how both judge
their endpoint. A link parses each answer once and ends its request through the lifecycle.

May import: govwire, admission/ and lifecycle.py. Never doors/ (answers reach a client only
through the lifecycle and the request's owner), the state, metrics or the server shell.
"""
