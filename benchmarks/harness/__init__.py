"""What the benchmarks share; nothing here is a benchmark of its own. The benchmark folders import
this package and never each other (tests/unit/benchmarks/test_imports.py).

- `common`: start a governor (with its front door) or a standalone worker on free loopback ports,
  stop it, read its stats, RSS and CPU time; table formatting; benchmarks/out/.
- `results`: the result file every benchmark writes (figures, baselines, command, commit, machine).
- `rounds`: alternating rounds and medians over them, for every side-by-side comparison.
- `experiment`: seeded open-loop arrivals through governors in front of one worker (the admission
  experiments' skeleton).
- `model_dir`: local GPT-2 directories saved with `save_pretrained` (`python -m
  benchmarks.harness.model_dir [--trained]`); `gguf_convert`: llama.cpp's converter for them.
- `workloads`: the named prompt sets the engine is measured on, here and beside llama.cpp.
- `yield_path`: frames/s refused by a governor whose only slot is held (the cost benchmarks' and
  the fleet's yield-path runs).
- `fixtures/`: what the tests start too (a tiny GPT-2, redis-server, a fault proxy, the fleet's
  probes, `transformers serve`, a serial OpenAI-compatible server), kept here so that no benchmark
  imports tests/.
- `sse_burst_client`: one streamed completion retried at each 429's hint, as an asyncio protocol
  or with httpx (openai_upstream's clients).
- Load tools started as processes: `yield_client` (pipelined NDJSON frames), `http_yield_client`
  (the same over HTTP), `storm_client` (a refusal storm at a set rate), `burn` (a CPU burner at a
  duty cycle, the storm's control), `bare_server` (the least an NDJSON server can do per frame).
"""
