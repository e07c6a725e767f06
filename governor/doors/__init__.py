"""The doors: where a client's bytes become frames and the governor's answers become bytes.

A frame goes through one door, then `Admission.decide` (admission/), then the lifecycle
(lifecycle.py), which a link (links/) drives to its end; the door renders what the lifecycle
decided. `connection.py` is the asyncio adapter that moves bytes between a socket and its door;
`ndjson.py` (the NDJSON port) and `http.py` (the OpenAI-compatible front door, with the mapping
of `openai_api.py`) are sans-IO; `shared.py` holds the step both take after a grant;
`gateway.py` reads an inference gateway's headers under `gateway_policy.py` (configuration).

May import: govwire, admission/, accounting.py, lifecycle.py and state.py. Never links/ (a door
reaches its endpoints only through the lifecycle's dispatcher), metrics or the server shell.
"""
