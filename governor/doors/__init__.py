"""The doors: where a client's bytes become frames and the governor's answers become bytes.

A door parses a frame; the one decision step both doors share (`shared.py`: admission's decision
through the lifecycle, a returning client held in the lobby, a refusal counted and hinted, a grant
admitted and dispatched) answers it, through the door's renderers; the lifecycle (lifecycle.py),
which a link (links/) drives, ends it, and the door renders that too. `connection.py` is the asyncio
adapter that moves bytes between a socket and its door, and `turns.py` shares the reads fairly
between connections; `ndjson.py` (the NDJSON port) and `http.py` (the OpenAI-compatible exchange,
over the HTTP/1.1 mechanics of `http_wire.py`, the mapping of `openai_api.py` and the responses of
`openai_response.py`) are sans-IO; `gateway.py` reads an inference gateway's headers under
`gateway_policy.py` (configuration).

May import: govwire, admission/, accounting.py, lifecycle.py and state.py. Never links/ (a door
reaches its endpoints only through the lifecycle's dispatcher), the read side or the server
shell; neither door imports the other, and neither decides or reads the appointments itself.
"""
