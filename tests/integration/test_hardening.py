"""Issue 6 against real processes: auth on both hops, connection limits, a hung spawned worker."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from govwire.codec import encode, generate_frame
from tests.integration.conftest import Governor, Worker

pytestmark = pytest.mark.integration
Start = Callable[..., Governor]
TOKEN = "correct-horse-battery-staple"


def read_all(sock: socket.socket) -> list[dict[str, object]]:
    """Every reply until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return [orjson.loads(line) for line in data.splitlines()]


def test_clients_must_authenticate_first_and_the_token_is_never_logged(start_governor: Start, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    gov = start_governor("--auth-token-file", str(token_file), "--log-level", "debug")
    with socket.create_connection(("127.0.0.1", gov.port), timeout=10) as sock:
        sock.sendall(encode(generate_frame("a", "hi")))
        assert [r.get("code") for r in read_all(sock)] == ["unauthorized"]  # then closed
    with socket.create_connection(("127.0.0.1", gov.port), timeout=10) as sock:
        sock.sendall(b'{"op":"auth","token":"guess"}\n' + encode(generate_frame("b", "hi")))
        assert [r.get("code") for r in read_all(sock)] == ["unauthorized"]
    gov.token = TOKEN
    c = gov.conn()
    c.send("c", "hi", max_new_tokens=2)
    assert c.until_final("c")[-1]["status"] == "done"
    send = [
        sys.executable,
        "-m",
        "governor",
        "send",
        "--address",
        f"127.0.0.1:{gov.port}",
        "--auth-token-file",
        str(token_file),
    ]
    out = subprocess.run([*send, "hello"], capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout == "hello\n"
    stats = gov.stats()
    assert stats["connections_shed"]["unauthorized"] == 2 and stats["rejected_by_reason"]["unauthorized"] == 2
    assert stats["received_total"] == 4 and stats["executed_total"] == 2
    assert gov.stop() == 0
    assert TOKEN not in gov.log.read_text() and "guess" not in gov.log.read_text()


def test_spawned_workers_listen_on_a_private_socket_and_refuse_links_without_the_run_secret(
    start_governor: Start,
) -> None:
    gov = start_governor()
    path = gov.stats()["workers"][0]["address"].removeprefix("unix:")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
    with socket.socket(socket.AF_UNIX) as sock:  # same user, so the modes let us in; the secret does not
        sock.settimeout(10)
        sock.connect(path)
        sock.sendall(encode(generate_frame("x", "hi")))
        replies = read_all(sock)
    assert [r.get("code") for r in replies if r.get("status") == "error"] == ["unauthorized"]
    assert not [r for r in replies if r.get("status") in ("token", "done")]


def test_an_external_worker_serves_only_a_governor_holding_its_secret(
    start_worker: Callable[..., Worker], start_governor: Start, tmp_path: Path
) -> None:
    token_file = tmp_path / "worker-token"
    token_file.write_text(TOKEN)
    worker = start_worker("--engine", "echo", "--auth-token-file", str(token_file))
    gov = start_governor("--worker", worker.address, "--worker-auth-token-file", str(token_file))
    c = gov.conn()
    c.send("a", "hi", max_new_tokens=2)
    assert c.until_final("a")[-1]["text"] == "hi"
    stranger = start_governor("--worker", worker.address, wait_ready=False)  # no secret: never up
    time.sleep(1.0)
    assert not stranger.stats()["workers"][0]["up"]
    s = stranger.conn()
    s.send("b", "hi")
    assert s.until_final("b")[-1]["code"] == "worker_unavailable"
    log = stranger.log.read_text()
    assert "event=worker_refused" in log and "unauthorized" in log
    assert "event=worker_connected" not in log  # at INFO it would claim a link the worker refused
    status, body = stranger.http("/readyz")
    assert status == 503 and "refused: unauthorized" in body, body


def test_connections_past_the_limit_are_refused_and_idle_ones_are_closed(start_governor: Start) -> None:
    gov = start_governor("--max-connections", "2", "--idle-timeout-s", "1", worker_args=("--token-delay-ms", "60"))
    first, second = gov.conn(), gov.conn()
    with socket.create_connection(("127.0.0.1", gov.port), timeout=10) as third:
        assert [r.get("code") for r in read_all(third)] == ["too_many_connections"]
    first.send("a", "hi", max_new_tokens=40, stop_on_eos=False)  # in flight ~2.4 s: never idle meanwhile
    time.sleep(1.8)
    second_replies = read_all(second.sock)
    assert [r.get("code") for r in second_replies] == ["idle_timeout"]
    assert first.until_final("a")[-1]["status"] == "done"
    shed = gov.stats()["connections_shed"]  # a new connection fits again now that one was closed
    assert shed["max_connections"] == 1 and shed["idle_timeout"] >= 1


def test_a_hung_spawned_worker_is_killed_and_restarted(start_governor: Start) -> None:
    gov = start_governor("--worker-ping-interval-s", "0.1", "--worker-ping-timeout-s", "0.5")
    (worker,) = gov.stats()["workers"]
    c = gov.conn()
    c.send("a", "hi", max_new_tokens=2)
    assert c.until_final("a")[-1]["status"] == "done"
    os.kill(worker["pid"], signal.SIGSTOP)  # alive, holding its socket, answering nothing
    stopped = time.monotonic()
    c.send("b", "hi", max_new_tokens=2)
    assert c.until_final("b")[-1]["code"] == "worker_lost"
    assert time.monotonic() - stopped < 2.0

    def restarted() -> bool:
        workers = gov.stats()["workers"]
        return bool(workers[0]["up"]) and workers[0]["pid"] != worker["pid"]

    gov.wait_until(restarted, what="a fresh worker")
    c.send("c", "back", max_new_tokens=4)
    assert c.until_final("c")[-1]["text"] == "back"
    assert gov.stats()["worker_restarts"] == 1


def test_a_client_that_never_reads_is_cut_past_the_write_buffer_cap(start_governor: Start) -> None:
    gov = start_governor("--max-write-buffer-bytes", "65536", "--max-new-tokens-limit", "4096")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
        sock.connect(("127.0.0.1", gov.port))
        # 32 x 4096 streamed tokens of ~70 bytes: 9 MB of replies, past what the kernel buffers (~4 MB).
        frames = (generate_frame(f"r{i}", "x" * 64, max_new_tokens=4096, stop_on_eos=False) for i in range(32))
        sock.sendall(b"".join(map(encode, frames)))
        gov.wait_until(lambda: gov.stats()["connections_shed"]["write_buffer"] == 1, what="the cut")
    stats = gov.stats()
    assert stats["inflight"] == 0 and stats["failed_by_reason"]["connection_shed"] > 0
    assert stats["received_total"] == stats["executed_total"] + stats["failed_total"] == 32


def test_while_the_worker_loads_its_model_the_governor_is_alive_not_ready_and_says_so(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--engine", "gpt2", "--model", "random-tiny"), wait_ready=False)
    assert gov.http("/healthz")[0] == 200 and gov.http("/readyz")[0] == 503  # importing torch takes seconds
    c = gov.conn()
    c.send("early", "hi", max_new_tokens=2)
    assert c.until_final("early")[-1]["code"] == "worker_unavailable"
    gov.wait_until(lambda: gov.http("/readyz")[0] == 200, timeout=120, what="the model loaded")
    c.send("late", "hi", max_new_tokens=2, stop_on_eos=False)
    final = c.until_final("late")[-1]
    assert final["status"] == "done" and final["completion_tokens"] == 2


def test_a_worker_told_to_stop_finishes_its_running_requests_first(
    start_worker: Callable[..., Worker], start_governor: Start
) -> None:
    worker = start_worker("--engine", "echo", "--token-delay-ms", "50")
    gov = start_governor("--worker", worker.address)
    c = gov.conn()
    c.send("long", "abcd", max_new_tokens=20, stop_on_eos=False)  # ~1 s
    assert c.recv()["status"] == "token"
    worker.proc.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    c.send("late", "x", max_new_tokens=2)
    replies = {r["id"]: r for r in (c.until_final("late")[-1], c.until_final("long")[-1])}
    assert replies["late"]["code"] == "worker_unavailable"  # refused while draining
    assert replies["long"]["status"] == "done" and replies["long"]["finish_reason"] == "length"
    assert worker.proc.wait(10) == 0
