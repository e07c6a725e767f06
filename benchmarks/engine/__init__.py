"""The worker's engine: speed against transformers, on the CPU and a GPU, and its scheduling knobs.

- `engine_vs_hf`: the engine in-process and served against transformers' `generate` and its
  continuous batching (`make bench-engine`).
- `dtypes`: what `--dtype auto` picks, each dtype's speed and accuracy against float32.
- `gpu`: batch 1/32/256 on a GPU against HF `generate`, the decode step, kernel launches.
- `chunked_prefill`: long prompts arriving among running streams, by prefill budget.
- `kv_paging`: prefix caching, over-asking clients, a KV pool under pressure.
- `prefill_admission`: the prefill admission knob under decode batch 8.
- `tokenize_stall`: inter-token latency while a 1 MiB prompt is tokenized.
- `small_host`: the worker beside its load generator on 2 cores.

`make bench-all-engine` runs the CPU ones.
"""
