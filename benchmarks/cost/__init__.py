"""The governor's own cost: what it adds to a refusal and to an admitted request.

- `yield_throughput`: refusals/s against a bare uvloop + orjson server, same client, same run.
- `admitted_overhead`: latency added to an admitted request, through the governor vs straight to
  the worker.
- `inprocess_cost`: CPU per yielded frame and per admitted request, in-process, no sockets.
- `http_front`: the OpenAI-compatible front door against the NDJSON port of the same governor.
- `memory`: RSS idle, with idle connections, and after 100k and 200k requests.

`make bench-all-cost` runs them all (`make bench` the first and the last).
"""
