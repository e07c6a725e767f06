"""The project's measurements, by purpose: each folder one kind, each script one benchmark.

    harness/     what the benchmarks share: starting governors and workers on loopback, local model
                 directories, the load clients they start as processes, alternating rounds, the
                 open-loop experiment skeleton, and the result files; fixtures/ in it, the servers
                 and tiny model the tests start too (benchmarks never import tests/)
    peers/       the governor and its engine beside other software, in the same sitting: nginx and
                 HAProxy, llama.cpp's server, transformers serve, aiperf and guidellm, httpx/aiohttp
    cost/        the governor's own cost: refusals/s and added latency against a bare server and
                 between its doors, CPU per request in-process, memory
    admission/   does a limit hold what it promises: bursts, load sweeps, token budgets, deadlines,
                 tenants and classes, fleet caps, the pool's limits, retry hints with the openai SDK
    engine/      the worker's engine: against transformers' generate, dtypes, chunked prefill, the
                 paged KV cache, prefill admission, tokenization, a small host, a GPU
    robustness/  hostile input and long runs: the raw-byte fuzzer and the soak

Run one as a module from the repository root, e.g. `python -m benchmarks.cost.yield_throughput`
(`--help` says what it does; most have a `make bench-*` target). Each writes its figures, its
command, its commit and its machine to `benchmarks/results/<folder>/<name>.json`; `python -m
benchmarks.report` (`make bench-report`) builds docs/BENCHMARKS.md from those files. Raw outputs
(logs, plots, per-run reports) go to `benchmarks/out/`, which is not committed.
"""
