"""Does a limit hold what it promises? Admission through a real governor, mostly in front of GPT-2.

- `burst`: a prefill-heavy burst with and without `--max-inflight` (tail latency).
- `load_sweep`: goodput from 10% to 150% of capacity, with and without the cap.
- `submit_schedule`: relative vs absolute submit schedules of the load generator.
- `token_admission`: token budgets against request caps, deadlines, the adaptive limit.
- `tenants`: a noisy neighbour, tenant weights, priority classes.
- `fleet`: fleet caps shared by three replicas through Redis.
- `pool_limits`: `--max-qps` accuracy and whether retries at the hint get in.
- `echo_burst`: a burst whose refused clients come back exactly at their hint: admitted on return, lobby wait.
- `openai_sdk_retries`: the real openai SDK at its defaults against an overloaded front door.

`make bench-all-admission` runs them all; each has its own `make bench-*` target.
"""
