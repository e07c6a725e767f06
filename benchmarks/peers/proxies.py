#!/usr/bin/env python3
# ruff: noqa: E501  (the nginx and HAProxy configurations it writes keep their long lines)
"""The governor's own cost next to real servers: nginx and HAProxy beside its refusal and admitted paths.

Every server under test is pinned to core 0 (`taskset -c 0`) and every load generator to core 1
(`taskset -c 1`), so each side has one core of the 2-core machine. Servers stay up for the whole
sitting; the rounds rotate the order of the servers so that the machine's drift hits all of them.
Each server's own CPU time per answered request is read from /proc (utime+stime over the run),
which is less at the mercy of the load generator than a rate.

  refusals   429s/s and latency: the governor's HTTP front door (--max-inflight 1, the slot held by
             one long echo request, as benchmarks/cost/http_front.py does), nginx `return 429`, nginx
             `limit_req` (a real limiter), haproxy `http-request return 429`, haproxy stick-table
             rate limiter; wrk at 16 and 64 keep-alive connections (one request in flight each) and
             16 connections x 16 pipelined. The same JSON error body and retry headers everywhere.
  ndjson     the NDJSON yield path pinned: the governor vs benchmarks/harness/bare_server.py, driven by the
             project's own benchmarks/harness/yield_client.py (4 x 1,024 and 32 x 64 in flight).
  admitted   added latency in front of one upstream: an nginx on core 1 serving a canned streamed
             /v1/completions (SSE, 4 tokens + usage); wrk straight to it, through nginx proxy_pass
             (core 0), through the governor's front door with it as an OpenAI-compatible endpoint
             (core 0), and through the governor's front door to its own echo worker (worker on core 1).
  isolation  admitted TTFT while a storm of refusals hits the same governor: the governor on core 0
             (--max-inflight 64 --tenant storm,max_inflight=1 --tenant-from frame: the storm's
             frames, tenant `storm`, are refused but one at a time, the others admitted), echo worker, `governor bench` (16 clients,
             closed loop) and storm_client.py on core 1, at several storm rates.

Run from the project root with the project's venv (docs/benchmarks/sittings.md §13 has the commands):
    python -m benchmarks.peers.proxies refusals --json out/refusals.json
Each part writes its own result file, benchmarks/results/peers/proxies-<part>.json, so that running
one part keeps the others' figures; `admitted` with a --tokens other than 4 is a part of its own
(proxies-admitted-<n>-tokens.json), since its bars are stated for the short stream.
Needs nginx (nginx-light), haproxy, wrk and taskset: `make bench-anchors` installs them from
Debian's packages, as `make test` installs redis-server. Every process it starts is stopped by its PID.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen
from typing import Any

from benchmarks.harness import rounds
from benchmarks.harness.common import HARNESS, free_port, wait_for_port
from benchmarks.harness.results import Sitting

ROOT = Path.cwd()
PY = sys.executable
SERVER_CORE, LOAD_CORE = "0", "1"
MODEL = "gpt2"
PROMPT = "Summarise the following support ticket in one sentence: my order arrived late."
# The governor's own 429 body for an `inflight` yield (doors/http.py _YIELD_BODY):
BODY_429 = '{"error":{"message":"yielded: inflight","type":"rate_limit_error","param":null,"code":"inflight","reason":"inflight"}}'
STARTED: list[Popen] = []


# -- processes ------------------------------------------------------------------------------------


def start(argv: list[str], core: str, log: Path | None = None, **kw: Any) -> Popen:
    out = open(log, "wb") if log else subprocess.DEVNULL  # noqa: SIM115
    proc = Popen(["taskset", "-c", core, *argv], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, **kw)
    STARTED.append(proc)
    return proc


def stop(proc: Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc in STARTED:
        STARTED.remove(proc)


def stop_all() -> None:
    for proc in list(reversed(STARTED)):
        stop(proc)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(threshold: float = 0.10, max_wait_s: float = 60.0) -> float:
    """Before a measurement (our servers idle): wait until the machine's other work uses less than
    `threshold` of the two cores, for up to `max_wait_s`. Returns the busy share last seen."""
    deadline = time.monotonic() + max_wait_s
    while True:
        before = core_times()
        time.sleep(0.5)
        busy = core_busy(before, core_times())
        share = sum(busy.values()) / max(1, len(busy))
        if share < threshold or time.monotonic() > deadline:
            return share
        time.sleep(1.0)


# -- configs --------------------------------------------------------------------------------------


def nginx_conf(d: Path, comment: str, http: str) -> str:
    """An nginx config for one process (the caller pins it with taskset), logs and pid under `d`,
    keep-alive connections that last for the whole run, and `http` as the rest of its http block."""
    return f"""# {comment}
daemon off;
master_process off;
worker_processes 1;
error_log {d}/error.log warn;
pid {d}/nginx.pid;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    server_tokens off;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
{http}}}
"""


def nginx_refuse_conf(d: Path, port_return: int, port_limit: int) -> str:
    return nginx_conf(
        d,
        f"nginx, one process (master_process off), pinned with taskset -c {SERVER_CORE}",
        f"""    default_type application/json;
    limit_req_zone $server_name zone=refuse:1m rate=1r/m;
    server {{  # 1. the cheapest refusal nginx can give: `return 429` in the rewrite phase
        listen 127.0.0.1:{port_return} backlog=4096;
        location / {{
            add_header retry-after-ms 9876 always;
            add_header retry-after 10 always;
            return 429 '{BODY_429}';
        }}
    }}
    server {{  # 2. a real limiter: limit_req (leaky bucket in shared memory), one request a minute
        listen 127.0.0.1:{port_limit} backlog=4096;
        limit_req zone=refuse nodelay;
        limit_req_status 429;
        error_page 429 @refused;
        location / {{ root {d}/www; }}
        location @refused {{
            add_header retry-after-ms 9876 always;
            add_header retry-after 10 always;
            return 429 '{BODY_429}';
        }}
    }}
""",
    )


def haproxy_refuse_conf(d: Path, port_return: int, port_stick: int) -> str:
    return f"""# haproxy, one thread, foreground (-db), pinned with taskset -c {SERVER_CORE}
global
    nbthread 1
    maxconn 8000
    pidfile {d}/haproxy.pid
defaults
    mode http
    timeout client 300s
    timeout connect 5s
    timeout server 30s
    timeout http-keep-alive 300s
frontend refuse_return
    # 1. the cheapest refusal: answer every request 429 from the frontend
    bind 127.0.0.1:{port_return}
    http-request return status 429 content-type application/json hdr retry-after-ms 9876 hdr retry-after 10 string '{BODY_429}'
frontend refuse_stick
    # 2. a real limiter: a stick table counting each client address's request rate
    bind 127.0.0.1:{port_stick}
    stick-table type ip size 100k expire 60s store http_req_rate(60s)
    http-request track-sc0 src
    http-request return status 429 content-type application/json hdr retry-after-ms 9876 hdr retry-after 10 string '{BODY_429}' if {{ sc_http_req_rate(0) gt 1 }}
    http-request return status 200 content-type application/json string '{{}}'
"""


def sse_body(tokens: int = 4) -> str:
    chunks = []
    for i in range(tokens):
        obj = {
            "id": "cmpl-u",
            "object": "text_completion",
            "created": 1,
            "model": MODEL,
            "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None if i < tokens - 1 else "length"}],
        }
        chunks.append("data: " + json.dumps(obj, separators=(",", ":")) + "\n\n")
    usage = {
        "id": "cmpl-u",
        "object": "text_completion",
        "created": 1,
        "model": MODEL,
        "choices": [],
        "usage": {"prompt_tokens": 16, "completion_tokens": tokens, "total_tokens": 16 + tokens},
    }
    chunks.append("data: " + json.dumps(usage, separators=(",", ":")) + "\n\n")
    chunks.append("data: [DONE]\n\n")
    return "".join(chunks)


def write_admitted_confs(d: Path, port_u: int, port_p: int, tokens: int) -> tuple[Path, Path]:
    body = sse_body(tokens).replace("'", "\\'")
    models = '{"object":"list","data":[{"id":"gpt2","object":"model","owned_by":"anchor"}]}'
    up = d / "upstream"
    px = d / "proxy"
    for sub in (up, px):
        sub.mkdir(parents=True, exist_ok=True)
    if len(body) < 3500:  # an nginx config string holds at most ~4 KB
        completions = f"location / {{ default_type text/event-stream; return 200 '{body}'; }}"
    else:  # a longer stream is served from a file; error_page turns the static module's 405 for POST into the file
        (up / "www" / "v1").mkdir(parents=True, exist_ok=True)
        (up / "www" / "v1" / "completions").write_text(sse_body(tokens))
        completions = f"location / {{ root {up}/www; default_type text/event-stream; error_page 405 =200 $uri; }}"
    upstream = f"""    server {{
        listen 127.0.0.1:{port_u} backlog=4096;
        location = /health {{ default_type application/json; return 200 '{{"status":"ok"}}'; }}
        location = /v1/models {{ default_type application/json; return 200 '{models}'; }}
        {completions}
    }}
"""
    comment = f"the upstream: a canned OpenAI-compatible streaming completion, one nginx process on core {LOAD_CORE}"
    (up / "nginx.conf").write_text(nginx_conf(up, comment, upstream))
    proxy = f"""    upstream u {{ server 127.0.0.1:{port_u}; keepalive 256; keepalive_requests 100000000; }}
    server {{
        listen 127.0.0.1:{port_p} backlog=4096;
        location / {{
            proxy_pass http://u;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
"""
    comment = (
        f"the proxy: nginx proxy_pass with pooled keep-alive upstream connections, one process on core {SERVER_CORE}"
    )
    (px / "nginx.conf").write_text(nginx_conf(px, comment, proxy))
    return up / "nginx.conf", px / "nginx.conf"


def wrk_script(d: Path, name: str, body: dict[str, Any], depth: int = 1) -> Path:
    payload = json.dumps(body, separators=(",", ":"))
    text = (
        f"-- POST /v1/completions, keep-alive; depth {depth} = requests pipelined per write\n"
        'wrk.method = "POST"\n'
        f"wrk.body = '{payload}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        'wrk.headers["Accept"] = "application/json"\n'
    )
    if depth > 1:
        text += (
            "init = function(args)\n"
            "  local r = {}\n"
            f"  for i = 1, {depth} do r[i] = wrk.format() end\n"
            "  req = table.concat(r)\n"
            "end\n"
            "request = function() return req end\n"
        )
    path = d / f"{name}.lua"
    path.write_text(text)
    return path


# -- wrk ------------------------------------------------------------------------------------------

_UNIT = {"us": 1e-3, "ms": 1.0, "s": 1000.0, "m": 60000.0}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text.strip())
    if not m:
        raise ValueError(text)
    return float(m.group(1)) * _UNIT[m.group(2)]


def wrk(url: str, script: Path, conns: int, seconds: float, server_pid: int | None) -> dict[str, Any]:
    quiet = wait_quiet()
    cpu0 = cpu_s(server_pid) if server_pid else 0.0
    t0 = time.perf_counter()
    out = subprocess.run(
        [
            "taskset",
            "-c",
            LOAD_CORE,
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{seconds:g}s",
            "--latency",
            "--timeout",
            "10s",
            "-s",
            str(script),
            url,
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    wall = time.perf_counter() - t0
    cpu = (cpu_s(server_pid) - cpu0) if server_pid else 0.0
    res: dict[str, Any] = {"raw_tail": out[-600:], "foreign_busy_before": quiet}
    res["rps"] = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    res["requests"] = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    res["non_2xx"] = int(non2xx.group(1)) if non2xx else 0
    errs = re.search(r"Socket errors: (.*)", out)
    res["socket_errors"] = errs.group(1) if errs else ""
    for q in ("50", "90", "99"):
        m = re.search(rf"^\s+{q}%\s+(\S+)", out, re.M)
        res[f"p{q}_ms"] = _ms(m.group(1)) if m else None
    res["server_cpu_s"] = cpu
    res["server_cpu_share"] = cpu / wall
    res["server_cpu_us_per_req"] = cpu / res["requests"] * 1e6 if res["requests"] else None
    return res


# -- the governor ---------------------------------------------------------------------------------


def gov_stats(port: int) -> dict[str, Any]:
    from governor.client import Client

    with Client("127.0.0.1", port, timeout=10) as c:
        return c.stats()


def start_governor(core: str, flags: list[str], worker: list[str] | None, log: Path) -> tuple[Popen, int]:
    port = free_port()
    argv = [PY, "-m", "governor", "serve", "--port", str(port), "--metrics-port", "0", "--log-level", "warning", *flags]
    if worker is not None:
        argv += ["--", *worker]
    proc = start(argv, core, log)
    wait_for_port(port)
    deadline = time.monotonic() + 60
    while not gov_stats(port)["workers"][0]["up"]:
        if time.monotonic() > deadline:
            raise TimeoutError("worker not up")
        time.sleep(0.1)
    return proc, port


def refusing_governor(d: Path) -> tuple[Popen, int, int, socket.socket]:
    """--max-inflight 1 with the slot held (benchmarks/cost/http_front.py's refusal setup)."""
    from governor.client import Client
    from govwire.codec import encode, generate_frame

    http_port = free_port()
    flags = ["--max-inflight", "1", "--http-port", str(http_port), "--integrity", "optional"]
    proc, port = start_governor(
        SERVER_CORE, flags, ["--engine", "echo", "--token-delay-ms", "1000"], d / "governor-refusing.log"
    )
    wait_for_port(http_port)
    with Client("127.0.0.1", port) as client:
        for _ in range(20):  # service times observed: the hint runs its adaptive path
            client.generate("")
    holder = socket.create_connection(("127.0.0.1", port))
    holder.sendall(encode(generate_frame("holder", "x", max_new_tokens=4096, stop_on_eos=False)))
    deadline = time.monotonic() + 20
    while gov_stats(port)["inflight"] != 1:
        if time.monotonic() > deadline:
            raise TimeoutError("holder not admitted")
        time.sleep(0.05)
    return proc, port, http_port, holder


# -- experiments ----------------------------------------------------------------------------------


def summarize(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> dict[str, float]:
    out = {}
    for k in keys:
        vals = [r[k] for r in rows if r.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    return out


def wrk_rounds(
    targets: dict[str, tuple[int, int]],
    script: Path,
    conns: int,
    a: argparse.Namespace,
    key: str,
    describe: Callable[[dict[str, Any]], str],
) -> dict[str, Any]:
    """wrk against every target (port, server pid) for `a.rounds` rounds, the order rotated each
    round; each run printed with `describe`; per target its runs and their medians."""
    per: dict[str, list[dict[str, Any]]] = {name: [] for name in targets}
    for r in range(a.rounds):
        for name in rounds.order(r, list(targets), rotate=True):
            port, pid = targets[name]
            res = wrk(f"http://127.0.0.1:{port}/v1/completions", script, conns, a.seconds, pid)
            per[name].append(res)
            print(f"{key} round {r + 1} {name}: {describe(res)}", flush=True)
    keys = ("rps", "p50_ms", "p99_ms", "server_cpu_us_per_req", "server_cpu_share")
    return {name: {"runs": runs, "median": summarize(runs, keys)} for name, runs in per.items()}


def run_refusals(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    nd = d / "nginx-refuse"
    (nd / "www").mkdir(parents=True, exist_ok=True)
    hd = d / "haproxy-refuse"
    hd.mkdir(parents=True, exist_ok=True)
    ports = {k: free_port() for k in ("nginx_return", "nginx_limit_req", "haproxy_return", "haproxy_stick")}
    (nd / "nginx.conf").write_text(nginx_refuse_conf(nd, ports["nginx_return"], ports["nginx_limit_req"]))
    (hd / "haproxy.cfg").write_text(haproxy_refuse_conf(hd, ports["haproxy_return"], ports["haproxy_stick"]))
    nginx = start(["nginx", "-p", str(nd), "-c", str(nd / "nginx.conf")], SERVER_CORE, nd / "stdout.log")
    haproxy = start(["haproxy", "-db", "-f", str(hd / "haproxy.cfg")], SERVER_CORE, hd / "stdout.log")
    gov, gov_port, gov_http, holder = refusing_governor(d)
    for p in ports.values():
        wait_for_port(p)
    targets = {
        "governor_http": (gov_http, gov.pid),
        "nginx_return": (ports["nginx_return"], nginx.pid),
        "nginx_limit_req": (ports["nginx_limit_req"], nginx.pid),
        "haproxy_return": (ports["haproxy_return"], haproxy.pid),
        "haproxy_stick": (ports["haproxy_stick"], haproxy.pid),
    }
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16}
    scripts = {1: wrk_script(d, "post", body), a.depth: wrk_script(d, f"post_pipe{a.depth}", body, a.depth)}
    configs = [(c, 1) for c in a.conns] + [(a.pipe_conns, a.depth)]
    results: dict[str, Any] = {"ports": ports, "configs": {}}
    try:
        for conns, depth in configs:
            key = f"c{conns}_d{depth}"
            results["configs"][key] = wrk_rounds(
                targets,
                scripts[depth],
                conns,
                a,
                key,
                lambda res: (
                    f"{res['rps']:,.0f} req/s, p50 {res['p50_ms']} ms, p99 {res['p99_ms']} ms,"
                    f" non-2xx {res['non_2xx']}/{res['requests']}, server CPU"
                    f" {res['server_cpu_us_per_req']:.2f} us/req ({res['server_cpu_share']:.0%})"
                ),
            )
        s = gov_stats(gov_port)
        results["governor_counts"] = {
            k: s.get(k)
            for k in ("received_total", "yielded_total", "executed_total", "rejected_total", "failed_total", "inflight")
        }
    finally:
        holder.close()
        stop(gov)
        stop(haproxy)
        stop(nginx)
    return results


def run_ndjson(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    bare_port = free_port()
    bare = start([PY, "-m", "benchmarks.harness.bare_server", str(bare_port)], SERVER_CORE, d / "bare.log")
    gov, gov_port, _, holder = refusing_governor(d)
    wait_for_port(bare_port)
    results: dict[str, Any] = {}
    try:
        for conns, window in ((4, 1024), (32, 64)):
            key = f"c{conns}_w{window}"
            per: dict[str, list[dict[str, Any]]] = {"bare": [], "governor": []}
            for r in range(a.rounds):
                sides = [("bare", bare_port, bare.pid), ("governor", gov_port, gov.pid)]
                for name, port, pid in rounds.order(r, sides):
                    wait_quiet()
                    cpu0 = cpu_s(pid)
                    out = subprocess.run(
                        [
                            "taskset",
                            "-c",
                            LOAD_CORE,
                            PY,
                            "-m",
                            "benchmarks.harness.yield_client",
                            "--port",
                            str(port),
                            "--seconds",
                            str(a.seconds),
                            "--connections",
                            str(conns),
                            "--window",
                            str(window),
                            "--batch",
                            "64",
                        ],
                        cwd=ROOT,
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    res = json.loads(out.stdout)
                    # (the client's warm-up is in the CPU span too: per-frame CPU is an upper bound)
                    res["server_cpu_s"] = cpu_s(pid) - cpu0
                    per[name].append(res)
                    print(
                        f"{key} round {r + 1} {name}: {res['frames_per_s']:,.0f} frames/s,"
                        f" client CPU {res['client_cpu_share']:.0%}, server CPU {res['server_cpu_s']:.2f} s",
                        flush=True,
                    )
            ratios = [g["frames_per_s"] / b["frames_per_s"] for g, b in zip(per["governor"], per["bare"], strict=True)]
            results[key] = {
                "bare": per["bare"],
                "governor": per["governor"],
                "median_bare": statistics.median(x["frames_per_s"] for x in per["bare"]),
                "median_governor": statistics.median(x["frames_per_s"] for x in per["governor"]),
                "median_paired_ratio": statistics.median(ratios),
            }
            print(f"{key}: governor/bare paired median {results[key]['median_paired_ratio']:.2f}", flush=True)
    finally:
        holder.close()
        stop(gov)
        stop(bare)
    return results


def run_admitted(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    port_u, port_p, port_w = free_port(), free_port(), free_port()
    up_conf, px_conf = write_admitted_confs(d / f"admitted-{a.tokens}", port_u, port_p, a.tokens)
    upstream = start(["nginx", "-p", str(up_conf.parent), "-c", str(up_conf)], LOAD_CORE)
    proxy = start(["nginx", "-p", str(px_conf.parent), "-c", str(px_conf)], SERVER_CORE)
    wait_for_port(port_u)
    wait_for_port(port_p)
    gov_u_http = free_port()
    gov_u, _ = start_governor(
        SERVER_CORE,
        [
            "--http-port",
            str(gov_u_http),
            "--integrity",
            "optional",
            "--max-inflight",
            "1024",
            "--worker",
            f"http://127.0.0.1:{port_u}/v1,model={MODEL},concurrency=1024",
        ],
        None,
        d / "governor-openai.log",
    )
    worker = start(
        [PY, "-m", "worker", "serve", "--engine", "echo", "--listen", f"127.0.0.1:{port_w}", "--log-level", "warning"],
        LOAD_CORE,
        d / "echo-worker.log",
    )
    wait_for_port(port_w)
    gov_w_http = free_port()
    gov_w, _ = start_governor(
        SERVER_CORE,
        [
            "--http-port",
            str(gov_w_http),
            "--integrity",
            "optional",
            "--max-inflight",
            "1024",
            "--worker",
            f"127.0.0.1:{port_w}",
        ],
        None,
        d / "governor-echo.log",
    )
    wait_for_port(gov_u_http)
    wait_for_port(gov_w_http)
    targets = {
        "direct_upstream": (port_u, upstream.pid),
        "nginx_proxy": (port_p, proxy.pid),
        "governor_openai_upstream": (gov_u_http, gov_u.pid),
        "governor_echo_worker": (gov_w_http, gov_w.pid),
    }
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": a.tokens, "stream": True}
    script = wrk_script(d, f"post_stream{a.tokens}", body)
    results: dict[str, Any] = {}
    try:
        for conns in a.conns:
            key = f"c{conns}_t{a.tokens}"
            results[key] = wrk_rounds(
                targets,
                script,
                conns,
                a,
                key,
                lambda res: (
                    f"{res['rps']:,.0f} req/s, p50 {res['p50_ms']} ms, p99 {res['p99_ms']} ms,"
                    f" non-2xx {res['non_2xx']}, errors {res['socket_errors']!r},"
                    f" proxy CPU {res['server_cpu_us_per_req'] or 0:.1f} us/req"
                ),
            )
    finally:
        for p in (gov_w, worker, gov_u, proxy, upstream):
            stop(p)
    return results


def core_times() -> dict[str, tuple[int, int]]:
    """(busy, total) jiffies per CPU from /proc/stat."""
    out = {}
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("cpu") and line[3:4].isdigit():
            name, *vals = line.split()
            v = list(map(int, vals))
            idle = v[3] + v[4]
            out[name] = (sum(v) - idle, sum(v))
    return out


def core_busy(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> dict[str, float]:
    return {k: (after[k][0] - before[k][0]) / max(1, after[k][1] - before[k][1]) for k in after}


def run_isolation(a: argparse.Namespace, d: Path) -> dict[str, Any]:
    """Admitted requests arrive open loop (Poisson, every --admit-interval-ms on average, over 16
    connections: an LLM worker's scale) while storm_client.py sends refused frames at each rate
    (0: none; -1: closed loop, 16 connections x 64 in flight, as fast as the governor answers).
    With --burn-control each storm level is followed by a control run: no storm, but burn.py
    loading the load core with the CPU share the storm client used, so that what the storm costs
    the admitted requests through the governor can be told from what it costs through the
    shared load core (the client, the worker and the storm client share core 1)."""
    port_w = free_port()
    worker = start(
        [PY, "-m", "worker", "serve", "--engine", "echo", "--listen", f"127.0.0.1:{port_w}", "--log-level", "warning"],
        LOAD_CORE,
        d / "iso-worker.log",
    )
    wait_for_port(port_w)
    gov, port = start_governor(
        SERVER_CORE,
        [
            "--max-inflight",
            "64",
            "--tenant",
            "storm,max_inflight=1",
            "--tenant-from",
            "frame",
            "--worker",
            f"127.0.0.1:{port_w}",
        ],
        None,
        d / "iso-governor.log",
    )
    storm_py = HARNESS / "storm_client.py"
    burn_py = HARNESS / "burn.py"
    results: dict[str, Any] = {"rounds": []}

    def measure(r: int, label: str, rate: int, load: Popen | None, storm: bool) -> dict[str, Any]:
        quiet = wait_quiet() if load is None else None
        stats0 = gov_stats(port)
        cpu0, y0, x0, t0, c0 = (
            cpu_s(gov.pid),
            stats0["yielded_total"],
            stats0["executed_total"],
            time.perf_counter(),
            core_times(),
        )
        jpath = d / f"iso_bench_{label}_{r}.json"
        subprocess.run(
            [
                "taskset",
                "-c",
                LOAD_CORE,
                PY,
                "-m",
                "governor",
                "bench",
                "--address",
                f"127.0.0.1:{port}",
                "--num-requests",
                str(a.requests),
                "--concurrency",
                "0",
                "--submit-schedule",
                "poisson",
                "--submit-interval-ms",
                str(a.admit_interval_ms),
                "--connections",
                "16",
                "--max-new-tokens",
                "4",
                "--poll-interval-ms",
                "60000",
                "--json",
                str(jpath),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        wall = time.perf_counter() - t0
        busy = core_busy(c0, core_times())
        gov_cpu = cpu_s(gov.pid) - cpu0
        stats1 = gov_stats(port)
        yielded = stats1["yielded_total"] - y0
        load_res = None
        if load is not None:
            load.send_signal(signal.SIGTERM)
            out, _ = load.communicate(timeout=30)
            STARTED.remove(load)
            if storm:
                load_res = json.loads(out.strip().splitlines()[-1])
        run = json.loads(jpath.read_text())["runs"][-1]
        summ = run["summary"]
        server_ttft = sorted(
            x["server"]["ttft_ms"] for x in run["samples"] if x.get("server") and x["server"].get("ttft_ms") is not None
        )
        row = {
            "label": label,
            "round": r + 1,
            "storm_target": rate,
            "quiet_before": quiet,
            "storm_refusals_per_s": yielded / wall,
            # the storm's own frames admitted (its tenant's one slot, 16 tokens each): work the governor does too
            "storm_admitted_per_s": (stats1["executed_total"] - x0 - summ["requests"]) / wall,
            "storm_client": load_res,
            "governor_cpu_share": gov_cpu / wall,
            "core_busy": busy,
            "requests": summ["requests"],
            "errors": summ["errors"],
            "yielded": summ["yielded"],
            "ttft_p50_ms": summ["ttft_ms"]["p50"],
            "ttft_p99_ms": summ["ttft_ms"]["p99"],
            "latency_p99_ms": summ["latency_ms"]["p99"],
            "server_ttft_p50_ms": server_ttft[len(server_ttft) // 2] if server_ttft else None,
            "server_ttft_p99_ms": server_ttft[int(0.99 * (len(server_ttft) - 1))] if server_ttft else None,
            "executed_rps": summ["requests"] / summ["wall_s"],
        }
        results["rounds"].append(row)
        print(
            f"round {r + 1} {label:>12}: refusals {row['storm_refusals_per_s']:,.0f}/s (storm admitted"
            f" {row['storm_admitted_per_s']:,.0f}/s), governor CPU"
            f" {row['governor_cpu_share']:.0%}, cores {busy.get('cpu0', 0):.0%}/{busy.get('cpu1', 0):.0%},"
            f" admitted TTFT p50 {row['ttft_p50_ms']:.3f} / p99 {row['ttft_p99_ms']:.3f} ms (governor-side"
            f" p50 {row['server_ttft_p50_ms']} / p99 {row['server_ttft_p99_ms']}), {row['executed_rps']:,.0f}"
            f" req/s, yielded {row['yielded']}, errors {row['errors']}",
            flush=True,
        )
        return row

    try:
        for r in range(a.rounds):
            for rate in rounds.order(r, a.rates):
                if not rate:
                    measure(r, "none", 0, None, False)
                    continue
                argv = [
                    "taskset",
                    "-c",
                    LOAD_CORE,
                    PY,
                    str(storm_py),
                    "--port",
                    str(port),
                    "--connections",
                    str(a.storm_conns),
                    "--seconds",
                    "600",
                    "--warmup",
                    "1.0",
                ]
                argv += ["--rate", "0", "--window", "64"] if rate < 0 else ["--rate", str(rate)]
                wait_quiet()
                storm = Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, text=True)
                STARTED.append(storm)
                time.sleep(2.0)
                row = measure(r, f"storm {rate}", rate, storm, True)
                if a.burn_control:
                    share = row["storm_client"]["client_cpu_share"]
                    wait_quiet()
                    burner = Popen(
                        ["taskset", "-c", LOAD_CORE, PY, str(burn_py), "--share", f"{share:.3f}"],
                        cwd=ROOT,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    STARTED.append(burner)
                    time.sleep(1.0)
                    measure(r, f"burn {rate}", rate, burner, False)
    finally:
        stop(gov)
        stop(worker)
    by_label: dict[str, list[dict[str, Any]]] = {}
    for row in results["rounds"]:
        by_label.setdefault(row["label"], []).append(row)
    results["median_by_label"] = {
        label: summarize(
            rows,
            (
                "storm_refusals_per_s",
                "governor_cpu_share",
                "ttft_p50_ms",
                "ttft_p99_ms",
                "server_ttft_p50_ms",
                "server_ttft_p99_ms",
                "executed_rps",
            ),
        )
        for label, rows in by_label.items()
    }
    return results


# -- the result file --------------------------------------------------------------------------------


def wrk_details(table: dict[str, Any]) -> dict[str, Any]:
    """A wrk_rounds table for the result file: per target its medians and its runs, without wrk's raw output."""
    return {
        name: {
            "median": side["median"],
            "runs": [{k: v for k, v in run.items() if k != "raw_tail"} for run in side["runs"]],
        }
        for name, side in table.items()
    }


def wrk_figure(
    sitting: Sitting,
    name: str,
    table: dict[str, Any],
    side: str,
    base: tuple[str, str],
    pick: str = "rps",
    unit: str = "req/s",
    at_least: float | None = None,
    headline: bool = True,
) -> None:
    """One target's median beside another's from the same wrk_rounds table (`base`: its key and its
    name in the figure); `at_least` is a bar on the ratio."""
    value, base_value = table[side]["median"][pick], table[base[0]]["median"][pick]
    ratio = value / base_value if value is not None and base_value else None
    sitting.figure(
        name,
        value,
        unit,
        baseline=(base[1], base_value),
        ratio=ratio,
        bar=f">= {at_least}x" if at_least is not None else None,
        met=ratio >= at_least if at_least is not None and ratio is not None else None,
        headline=headline,
    )


def refusals_figures(sitting: Sitting, a: argparse.Namespace, results: dict[str, Any]) -> None:
    """The governor's 429s/s beside nginx's real limiter (bar 1.0x), its cheapest 429 (bar 0.7x) and
    HAProxy's limiter; the bars unpipelined, headline at the first --conns."""
    sitting.details = {
        "configs": {key: wrk_details(table) for key, table in results["configs"].items()},
        "governor_counts": results["governor_counts"],
    }
    limit_req = ("nginx_limit_req", "nginx limit_req")
    peers = (
        (limit_req, 1.0),
        (("nginx_return", "nginx return 429"), 0.7),
        (("haproxy_stick", "HAProxy stick table"), None),
    )
    for key, table in results["configs"].items():
        conns, depth = (int(x[1:]) for x in key.split("_"))
        where = f"{conns} connections" + (f" x {depth} pipelined" if depth > 1 else "")
        first = depth == 1 and conns == a.conns[0]
        for base, bar in peers:
            name = f"HTTP 429s/s vs {base[1]}, {where}"
            at_least = bar if depth == 1 else None
            wrk_figure(
                sitting, name, table, "governor_http", base, at_least=at_least, headline=first and bar is not None
            )
        name = f"server CPU per 429, {where}"
        wrk_figure(
            sitting, name, table, "governor_http", limit_req, pick="server_cpu_us_per_req", unit="µs", headline=False
        )


def ndjson_figures(sitting: Sitting, a: argparse.Namespace, results: dict[str, Any]) -> None:
    """The NDJSON yield path's frames/s beside the bare server's, the median of per-round ratios."""
    sitting.details = {}
    for key, res in results.items():
        conns, window = (int(x[1:]) for x in key.split("_"))
        per_round = [g["frames_per_s"] / b["frames_per_s"] for g, b in zip(res["governor"], res["bare"], strict=True)]
        sitting.details[key] = {**res, "paired_ratios": per_round}
        sitting.figure(
            f"NDJSON refusals, {conns} connections x {window:,} in flight",
            res["median_governor"],
            "frames/s",
            baseline=("bare server", res["median_bare"]),
            ratio=res["median_paired_ratio"],
        )


def p50_added(table: dict[str, Any], side: str) -> float | None:
    """The median over rounds of a target's wrk p50 minus the upstream's own in the same round."""
    pairs = zip(table[side]["runs"], table["direct_upstream"]["runs"], strict=True)
    added = [run["p50_ms"] - direct["p50_ms"] for run, direct in pairs if None not in (run["p50_ms"], direct["p50_ms"])]
    return statistics.median(added) if added else None


def admitted_figures(sitting: Sitting, a: argparse.Namespace, results: dict[str, Any]) -> None:
    """Through the OpenAI link, against nginx proxy_pass in front of the same upstream: its req/s and
    CPU per request at the most clients, its p50 added over the upstream at the fewest (headline,
    nginx's beside it); the bars (>= 5,000 req/s, <= 0.3 ms added at p50) are stated for the short
    (4-token) stream."""
    sitting.details = {key: wrk_details(table) for key, table in results.items()}
    short = a.tokens == 4
    link, proxy = "governor_openai_upstream", ("nginx_proxy", "nginx proxy_pass")
    for conns in a.conns:
        table = results[f"c{conns}_t{a.tokens}"]
        where = f"{conns} client{'s' if conns > 1 else ''}, {a.tokens} tokens"
        most, fewest = conns == max(a.conns), conns == min(a.conns)
        rps = table[link]["median"]["rps"]
        floor = short and most
        sitting.figure(
            f"OpenAI link req/s, {where}",
            rps,
            "req/s",
            baseline=(proxy[1], table[proxy[0]]["median"]["rps"]),
            bar=">= 5,000 req/s" if floor else None,
            met=rps >= 5000 if floor and rps is not None else None,
            headline=most,
        )
        name = f"OpenAI link governor CPU per request, {where}"
        wrk_figure(sitting, name, table, link, proxy, pick="server_cpu_us_per_req", unit="µs", headline=most)
        bar = short and fewest
        for side, label, headline in ((link, "OpenAI link", fewest), (proxy[0], proxy[1], False)):
            added = p50_added(table, side)
            sitting.figure(
                f"{label} p50, {where}",
                table[side]["median"]["p50_ms"],
                "ms",
                baseline=("wrk straight to the upstream", table["direct_upstream"]["median"]["p50_ms"]),
                difference=added,
                bar="added <= 0.3 ms" if bar and side == link else None,
                met=added <= 0.3 if bar and side == link and added is not None else None,
                headline=headline,
            )
        sitting.figure(
            f"governor to its echo worker req/s, {where}",
            table["governor_echo_worker"]["median"]["rps"],
            "req/s",
            baseline=(proxy[1], table[proxy[0]]["median"]["rps"]),
            headline=False,
        )


def isolation_figures(sitting: Sitting, a: argparse.Namespace, results: dict[str, Any]) -> None:
    """Per storm rate, the admitted TTFT p99 beside its control (the CPU burner with --burn-control,
    else no storm) and what the storm adds: the median over rounds of storm minus control in the same
    round. Headline at the governor's maximum (bar: <= 2 ms added) and at 100,000/s (<= 0.5 ms), the
    bars against the burner."""
    sitting.details = {"median_by_label": results["median_by_label"], "rounds": results["rounds"]}
    rows = {(row["label"], row["round"]): row for row in results["rounds"]}

    def runs(label: str) -> list[dict[str, Any]]:
        return [rows[(label, r)] for r in range(1, a.rounds + 1)]

    bars = {-1: 2.0, 100_000: 0.5}
    control = "CPU-burn control" if a.burn_control else "no storm"
    for rate in a.rates:
        if not rate:
            continue
        storm = f"storm {rate}"
        text = "at its maximum" if rate < 0 else f"of {rate:,}/s"
        median = results["median_by_label"][storm]
        if a.burn_control or 0 in a.rates:
            controls = runs(f"burn {rate}" if a.burn_control else "none")
            diffs = [s["ttft_p99_ms"] - c["ttft_p99_ms"] for s, c in zip(runs(storm), controls, strict=True)]
            added = statistics.median(diffs)
            bar = bars.get(rate) if a.burn_control else None
            sitting.figure(
                f"admitted TTFT p99 during a storm {text}",
                median["ttft_p99_ms"],
                "ms",
                baseline=(control, statistics.median(c["ttft_p99_ms"] for c in controls)),
                difference=added,
                bar=f"added <= {bar:g} ms" if bar is not None else None,
                met=added <= bar if bar is not None else None,
                headline=rate in bars,
                note="added per round: " + ", ".join(f"{x:+.2f}" for x in diffs),
            )
        sitting.figure(f"refusals/s, storm {text}", median["storm_refusals_per_s"], "frames/s", headline=False)
        if 0 in a.rates:
            sitting.figure(
                f"admitted req/s during a storm {text}",
                median["executed_rps"],
                "req/s",
                baseline=("no storm", results["median_by_label"]["none"]["executed_rps"]),
                headline=False,
            )
        unserved = sum(run["yielded"] + sum(run["errors"].values()) for run in runs(storm))
        sitting.figure(f"admitted requests refused or failed, storm {text}", unserved, "requests", headline=False)


FIGURES: dict[str, Callable[[Sitting, argparse.Namespace, dict[str, Any]], None]] = {
    "refusals": refusals_figures,
    "ndjson": ndjson_figures,
    "admitted": admitted_figures,
    "isolation": isolation_figures,
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("refusals", "ndjson", "admitted", "isolation"))
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--conns", type=int, nargs="+", default=None)
    p.add_argument("--pipe-conns", type=int, default=16)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--rates", type=int, nargs="+", default=[0, 25_000, 50_000, 100_000, 150_000, -1])
    p.add_argument("--admit-interval-ms", type=float, default=2.0, help="isolation: mean gap between admitted requests")
    p.add_argument("--storm-conns", type=int, default=16)
    p.add_argument("--burn-control", action="store_true", help="isolation: a CPU-burner control after each storm")
    p.add_argument("--requests", type=int, default=5000)
    p.add_argument("--tokens", type=int, default=4, help="admitted: tokens per streamed completion")
    p.add_argument("--json", default="")
    p.add_argument("--workdir", default="")
    a = p.parse_args()
    if a.conns is None:
        a.conns = [16, 64] if a.what == "refusals" else [1, 16]
    default_tokens = a.tokens == p.get_default("tokens")  # a longer stream is a part of its own
    part = a.what if a.what != "admitted" or default_tokens else f"admitted-{a.tokens}-tokens"
    sitting = Sitting(("govwire", "governor"), part=part)
    if not (ROOT / "governor").is_dir():
        sys.exit("run this from the project root")
    for tool in ("taskset", "wrk", "nginx", "haproxy"):
        if shutil.which(tool) is None:
            sys.exit(f"{tool} not found: `make bench-anchors` installs nginx-light, haproxy and wrk (Debian)")
    d = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="hotpath-"))
    d.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    try:
        fn = {"refusals": run_refusals, "ndjson": run_ndjson, "admitted": run_admitted, "isolation": run_isolation}[
            a.what
        ]
        results = {
            "what": a.what,
            "args": vars(a),
            "workdir": str(d),
            "results": fn(a, d),
            "when": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
    finally:
        stop_all()
    text = json.dumps(results, indent=1, default=str)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(text)
    print(json.dumps({k: v for k, v in results.items() if k != "results"}, default=str))
    FIGURES[a.what](sitting, a, results["results"])
    sitting.write()
    return 0


if __name__ == "__main__":
    sys.exit(main())
