"""The issue's acceptance checks, each against a real governor and its real worker process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from govwire.codec import encode, generate_frame
from tests.integration.conftest import Governor, free_port

pytestmark = pytest.mark.integration
Start = Callable[..., Governor]


def test_streamed_echo_generate(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "1"))
    c = gov.conn()
    c.send("r1", "héllo", max_new_tokens=32)
    replies = c.until_final("r1")
    tokens, done = replies[:-1], replies[-1]
    assert [t["index"] for t in tokens] == list(range(6))
    assert "".join(t["text"] for t in tokens) == "héllo"
    assert done["status"] == "done" and done["text"] == "héllo" and done["finish_reason"] == "eos"
    assert (done["prompt_tokens"], done["completion_tokens"]) == (6, 6)
    assert 0 <= done["ttft_ms"] <= done["total_ms"] and "queue_wait_ms" in done
    c.send("r2", "abcdef", max_new_tokens=2, stream=False)
    (done2,) = c.until_final("r2")
    assert (done2["text"], done2["finish_reason"]) == ("ab", "length")


def test_closing_the_connection_cancels_even_a_non_streamed_request(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "50"))
    c = gov.conn()
    c.send("quiet", "q" * 200, max_new_tokens=200, stream=False)
    gov.wait_until(lambda: gov.stats()["inflight"] == 1, what="admission")
    c.sock.shutdown(socket.SHUT_WR)  # FIN: the governor treats the client as gone
    gov.wait_until(lambda: gov.stats()["inflight"] == 0, timeout=1.0, what="slot release on FIN")
    assert gov.stats()["failed_by_reason"]["client_disconnected"] == 1
    assert c.sock.recv(1) == b""


def test_null_means_absent_and_odd_ops_are_bad_frames(start_governor: Start) -> None:
    gov = start_governor()
    c = gov.conn()
    nulls = {
        "max_new_tokens": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
        "seed": None,
        "stop_on_eos": None,
        "stream": None,
        "op": None,
    }
    c.send("n", "nulls", **nulls)
    replies = c.until_final("n")
    assert [r["status"] for r in replies] == ["token"] * 5 + ["done"]
    assert replies[-1]["text"] == "nulls"
    # An unhashable op in the same read as a valid frame: both answered, connection kept.
    c.send_raw(b'{"id":"o","op":[1]}\n{"id":"o2","op":{"a":1}}\n' + encode(generate_frame("after", "ok")))
    assert [(r["id"], r["code"]) for r in (c.recv(), c.recv())] == [("o", "bad_frame"), ("o2", "bad_frame")]
    assert c.until_final("after")[-1]["text"] == "ok"
    stats = gov.stats()
    assert stats["inflight"] == 0 and stats["failed_total"] == 0
    assert stats["received_total"] == stats["executed_total"] + stats["rejected_total"]


def test_a_client_that_never_reads_is_paused_not_buffered(start_governor: Start) -> None:
    gov = start_governor()
    pid = gov.proc.pid

    def rss_mib() -> float:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    before = rss_mib()
    hog = socket.create_connection(("127.0.0.1", gov.port))
    hog.setblocking(False)
    chunk = b'{"id":"p","op":"ping"}\n' * 4096  # ~96 KiB of pings, ~150 KiB of pongs
    sent = 0
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and sent < 256 * 1024 * 1024:
        try:
            sent += hog.send(chunk)
        except BlockingIOError:
            time.sleep(0.01)
    # Loopback socket buffers hold a few MiB; past them the governor must have stopped reading.
    assert sent < 64 * 1024 * 1024, f"{sent} bytes accepted from a client that reads nothing"
    assert rss_mib() - before < 48
    other = gov.conn()
    other.send("still", "fine")
    assert other.until_final("still")[-1]["text"] == "fine"
    hog.close()


def test_burst_of_four_times_cap_admits_exactly_cap_and_yields_the_rest(start_governor: Start) -> None:
    cap = 4
    gov = start_governor("--max-inflight", str(cap), worker_args=("--first-token-delay-ms", "300"))
    conns = [gov.conn() for _ in range(4)]
    # Every frame is on the wire before the first completion (300 ms away): a true burst.
    for i, c in enumerate(conns):
        c.send_raw(b"".join(encode(generate_frame(f"c{i}-{j}", "xy", max_new_tokens=2)) for j in range(cap)))
    finals: dict[str, dict[str, object]] = {}
    for c in conns:
        finals.update(c.finals(cap))
        c.close()
    statuses = [f["status"] for f in finals.values()]
    assert len(finals) == 4 * cap
    assert statuses.count("done") == cap and statuses.count("yield") == 3 * cap
    yields = [f for f in finals.values() if f["status"] == "yield"]
    assert all(f["reason"] == "inflight" and int(f["retry_hint_ms"]) > 0 for f in yields)  # type: ignore[call-overload]
    stats = gov.stats()
    assert stats["inflight"] == 0 and stats["received_total"] == 4 * cap
    assert (stats["executed_total"], stats["yielded_total"]) == (cap, 3 * cap)


def test_every_error_code_while_the_connection_keeps_serving(start_governor: Start) -> None:
    gov = start_governor("--max-frame-bytes", "256", "--max-new-tokens-limit", "64")
    c = gov.conn()
    bystander = gov.conn()
    bystander.send("b1", "ok", max_new_tokens=4)
    cases = [
        (b"{not json\n", "bad_json", None),
        (b'{"id":"f1","prompt":7}\n', "bad_frame", "f1"),
        (encode(generate_frame("f2", "x", max_new_tokens=65)), "bad_frame", "f2"),
        (b'{"id":"' + b"z" * 300 + b'"}\n', "frame_too_large", None),
        (encode({**generate_frame("f3", "abc"), "size": 4}), "integrity", "f3"),
        (encode({**generate_frame("f4", "abc"), "sha256": "f" * 64}), "integrity", "f4"),
        (b'{"id":"f5","op":"format_disk"}\n', "unknown_op", "f5"),
        (b"\xff\xfe\x00garbage\n", "bad_json", None),
    ]
    for data, code, rid in cases:
        c.send_raw(data)
        reply = c.recv()
        assert (reply["status"], reply["code"], reply["id"]) == ("error", code, rid), reply
    # The bystander connection was never disturbed.
    assert bystander.until_final("b1")[-1]["text"] == "ok"
    c.send("after", "fine")
    assert c.until_final("after")[-1]["status"] == "done"
    stats = gov.stats()
    assert stats["rejected_total"] == len(cases)
    assert stats["inflight"] == 0
    assert stats["received_total"] == stats["executed_total"] + stats["rejected_total"] + stats["yielded_total"]


def test_duplicate_id_while_in_flight(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--first-token-delay-ms", "200"))
    c = gov.conn()
    c.send("same", "abc")
    c.send("same", "abc")
    first = c.recv()
    assert (first["status"], first["code"], first["id"]) == ("error", "duplicate_id", "same")
    assert c.until_final("same")[-1]["status"] == "done"
    assert gov.stats()["rejected_by_reason"]["duplicate_id"] == 1


def test_no_worker_gives_worker_unavailable(start_governor: Start) -> None:
    gov = start_governor("--worker", f"127.0.0.1:{free_port()}", wait_ready=False)
    c = gov.conn()
    c.send("w", "abc")
    reply = c.recv()
    assert (reply["status"], reply["code"]) == ("error", "worker_unavailable")
    assert gov.stats()["inflight"] == 0


def test_external_worker_over_tcp_with_optional_integrity(start_governor: Start) -> None:
    worker_port = free_port()
    argv = [sys.executable, "-m", "worker", "serve", "--listen", f"127.0.0.1:{worker_port}"]
    argv += ["--engine", "echo", "--token-delay-ms", "20"]

    def start_worker() -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    worker = start_worker()
    try:
        gov = start_governor("--worker", f"127.0.0.1:{worker_port}", "--integrity", "optional")
        c = gov.conn()
        c.send_raw(b'{"id":"plain","prompt":"no digest"}\n')  # optional: frames without size/sha256 pass
        assert c.until_final("plain")[-1]["text"] == "no digest"
        c.send_raw(b'{"id":"wrong","prompt":"abc","size":2}\n')  # but what is declared is checked
        assert c.recv()["code"] == "integrity"
        c.send("long", "l" * 100, max_new_tokens=100)
        assert c.recv()["status"] == "token"
        worker.kill()
        worker.wait()
        assert c.until_final("long")[-1]["code"] == "worker_lost"
        c.send("gap", "x")
        assert c.recv()["code"] == "worker_unavailable"
        assert gov.http("/readyz")[0] == 503
        worker = start_worker()  # the governor reconnects by itself
        gov.wait_until(lambda: gov.http("/readyz")[0] == 200, what="reconnect to the restarted worker")
        c.send("back", "again")
        assert c.until_final("back")[-1]["text"] == "again"
    finally:
        worker.kill()
        worker.wait()


def test_client_disconnect_mid_stream_frees_its_slot(start_governor: Start) -> None:
    gov = start_governor("--max-inflight", "1", worker_args=("--token-delay-ms", "20"))
    c = gov.conn()
    c.send("long", "x" * 500, max_new_tokens=500)
    assert c.recv()["status"] == "token"
    c.close()
    gov.wait_until(lambda: gov.stats()["inflight"] == 0, what="slot release after disconnect")
    assert gov.stats()["failed_by_reason"]["client_disconnected"] == 1
    c2 = gov.conn()
    c2.send("next", "ok")
    assert c2.until_final("next")[-1]["status"] == "done"


def test_killed_worker_fails_inflight_with_worker_lost_and_is_restarted(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "20"))
    (worker,) = gov.stats()["workers"]
    c = gov.conn()
    c.send("a", "x" * 300, max_new_tokens=300)
    c.send("b", "y" * 300, max_new_tokens=300)
    c.recv()
    os.kill(worker["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    finals = c.finals(2)
    assert time.monotonic() - killed_at < 1.0
    assert {f["code"] for f in finals.values()} == {"worker_lost"}
    assert gov.stats()["inflight"] == 0

    def restarted() -> bool:
        workers = gov.stats()["workers"]
        return bool(workers[0]["up"]) and workers[0]["pid"] != worker["pid"]

    gov.wait_until(restarted, what="worker restart")
    c.send("c", "back")
    assert c.until_final("c")[-1]["text"] == "back"
    stats = gov.stats()
    assert stats["worker_restarts"] == 1 and stats["failed_by_reason"]["worker_lost"] == 2


def test_metrics_endpoint_matches_what_was_sent(start_governor: Start) -> None:
    gov = start_governor("--max-inflight", "2", worker_args=("--first-token-delay-ms", "200"))
    c = gov.conn()
    c.send_raw(b"".join(encode(generate_frame(f"m{i}", "ab")) for i in range(5)) + b"]]\n")
    finals = c.finals(6)
    assert sorted(f["status"] for f in finals.values()) == ["done"] * 2 + ["error"] + ["yield"] * 3
    m = gov.metrics()
    assert m[("governor_received_total", ())] == 6
    assert m[("governor_executed_total", ())] == 2
    assert m[("governor_yielded_total", (("reason", "inflight"),))] == 3
    assert m[("governor_rejected_total", (("reason", "bad_json"),))] == 1
    assert m[("governor_inflight", ())] == 0 and m[("governor_max_inflight", ())] == 2
    assert m[("governor_request_duration_seconds_count", ())] == 2
    assert m[("governor_time_to_first_token_seconds_count", ())] == 2
    assert m[("governor_admission_decision_seconds_count", ())] == 5
    assert gov.http("/healthz")[0] == 200 and gov.http("/readyz")[0] == 200
    assert gov.http("/nope")[0] == 404


def test_sigterm_drains_inflight_then_exits_zero(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--first-token-delay-ms", "500"))
    c = gov.conn()
    c.send("inflight", "done-anyway")
    time.sleep(0.1)
    gov.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    c.send("late", "x")
    late = c.recv()
    assert (late["id"], late["status"], late["reason"]) == ("late", "yield", "draining")
    assert c.until_final("inflight")[-1]["text"] == "done-anyway"
    assert gov.proc.wait(10) == 0
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", gov.port), timeout=1).close()


@pytest.mark.parametrize("cut_short", [False, True], ids=["drain-timeout", "second-signal"])
def test_what_the_drain_leaves_is_cancelled(start_governor: Start, cut_short: bool) -> None:
    drain_timeout = "60" if cut_short else "0.2"
    gov = start_governor("--drain-timeout-s", drain_timeout, worker_args=("--token-delay-ms", "50"))
    c = gov.conn()
    c.send("slow", "z" * 200, max_new_tokens=200)
    assert c.recv()["status"] == "token"
    gov.proc.send_signal(signal.SIGTERM)
    if cut_short:
        time.sleep(0.2)
        gov.proc.send_signal(signal.SIGINT)
    final = c.until_final("slow")[-1]
    assert (final["status"], final["finish_reason"]) == ("done", "cancelled")
    assert 0 < final["completion_tokens"] < 200
    assert gov.proc.wait(10) == 0


def test_send_command_prints_the_streamed_reply(start_governor: Start) -> None:
    gov = start_governor()
    out = subprocess.run(
        [sys.executable, "-m", "governor", "send", "--address", f"127.0.0.1:{gov.port}", "hello governor"],
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    assert out.stdout == "hello governor\n"
    assert "finish_reason=eos" in out.stderr
    piped = subprocess.run(
        [sys.executable, "-m", "governor", "send", "--address", f"127.0.0.1:{gov.port}", "-"],
        input="from stdin",
        capture_output=True,
        text=True,
        timeout=20,
        check=True,
    )
    assert piped.stdout == "from stdin\n"
    dead = subprocess.run(
        [sys.executable, "-m", "governor", "send", "--address", f"127.0.0.1:{free_port()}", "x"],
        capture_output=True,
        text=True,
        timeout=20,
    )
    assert dead.returncode == 1 and "is the governor running?" in dead.stderr


def test_a_worker_that_cannot_be_reached_is_logged_and_named_by_readyz(start_governor: Start) -> None:
    nothing = free_port()  # nothing listens there
    gov = start_governor("--worker", f"127.0.0.1:{nothing}", wait_ready=False)
    status, body = gov.http("/readyz")
    assert status == 503 and f"127.0.0.1:{nothing}: unreachable" in body, body
    gov.wait_until(lambda: "event=worker_unreachable" in gov.log.read_text(), what="the unreachable worker logged")
    assert "event=worker_connected" not in gov.log.read_text()


def test_a_taken_port_is_one_line_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["serve", "--port", str(port), "--metrics-port", "0", "--worker", f"127.0.0.1:{free_port()}"]
        run = subprocess.run([sys.executable, "-m", "governor", *argv], capture_output=True, text=True, timeout=60)
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if "level=" not in line]  # log lines aside
    assert errors == [errors[0]] and f"--port {port} is already in use" in errors[0], run.stderr
    assert "Traceback" not in run.stderr


def test_a_spawned_worker_is_labelled_by_its_place_not_its_socket(start_governor: Start) -> None:
    gov = start_governor()
    metrics = gov.metrics()
    assert metrics[("governor_endpoint_up", (("worker", "spawned-0"),))] == 1
    assert not [key for key in metrics if any("governor-" in value for _, value in key[1])]  # no temp path


def test_send_waits_for_a_worker_that_comes_up_late(start_governor: Start) -> None:
    worker_port = free_port()
    gov = start_governor("--worker", f"127.0.0.1:{worker_port}", wait_ready=False)
    cli = [sys.executable, "-m", "governor", "send", "--address", f"127.0.0.1:{gov.port}", "--max-new-tokens", "4"]
    gave_up = subprocess.run([*cli, "--wait-s", "1", "late"], capture_output=True, text=True, timeout=30)
    assert gave_up.returncode == 1 and "worker_unavailable" in gave_up.stderr
    assert "waiting for the governor's worker" in gave_up.stderr
    sender = subprocess.Popen([*cli, "--wait-s", "30", "late"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(1.0)
    argv = [sys.executable, "-m", "worker", "serve", "--listen", f"127.0.0.1:{worker_port}", "--engine", "echo"]
    worker = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, err = sender.communicate(timeout=60)
        assert sender.returncode == 0, err
        assert out.decode().strip() == "late"
        # The waiting asks `stats`, which counts no request: the one that gave up made one attempt,
        # and that is the only worker_unavailable (polling with requests made one every 0.5 s).
        stats = gov.stats()
        assert stats["failed_by_reason"]["worker_unavailable"] == 1, stats["failed_by_reason"]
        assert stats["received_total"] == 2 and stats["executed_total"] == 1
        # Straight to the worker, whose replies always stream: --no-stream prints the text once.
        direct = [*cli[:4], "--address", f"127.0.0.1:{worker_port}", "--max-new-tokens", "4", "--no-stream"]
        once = subprocess.run([*direct, "wxyz"], capture_output=True, text=True, timeout=30)
        assert (once.returncode, once.stdout) == (0, "wxyz\n"), once.stderr
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(30)


def test_send_says_whether_a_refusal_is_final_and_prints_it_with_json(start_governor: Start) -> None:
    # One slot, held by a request that ends ~4 s out: past the 1 s promise horizon.
    gov = start_governor("--max-inflight", "1", worker_args=("--token-delay-ms", "200"))
    hog = gov.conn()
    hog.send("hog", "x" * 20, max_new_tokens=20)
    assert hog.recv()["status"] in ("ack", "token")
    cli = [sys.executable, "-m", "governor", "send", "--address", f"127.0.0.1:{gov.port}", "--max-new-tokens", "2"]
    final = subprocess.run([*cli, "--json", "q"], capture_output=True, text=True, timeout=30)
    assert final.returncode == 3, final.stderr
    (line,) = final.stdout.splitlines()
    reply = orjson.loads(line)
    assert (reply["status"], reply["reason"], reply["final"]) == ("yield", "inflight", True)
    assert "final=true" in final.stderr and "do not retry" in final.stderr
    assert "retry_hint_ms" not in final.stderr  # a final hint is no invitation to come back
    hog.close()


def test_a_worker_that_cannot_start_is_not_restarted_in_a_loop_and_says_why(
    start_governor: Start, tmp_path: Path
) -> None:
    typo = str(tmp_path / "gtp2")
    gov = start_governor(worker_args=("--engine", "gpt2", "--model", typo), wait_ready=False)
    cause = f"--model '{typo}': no such directory"
    gov.wait_until(lambda: cause in gov.http("/readyz")[1], what="/readyz naming the cause")
    status, body = gov.http("/readyz")
    assert status == 503 and "spawned-0" in body and "could not start (exit code 2)" in body
    assert "next start in 300 s" in body
    (worker,) = gov.stats()["workers"]
    assert cause in worker["last_error"] and not worker["up"]
    screen = subprocess.run(
        [sys.executable, "-m", "governor", "status", "--address", f"127.0.0.1:{gov.port}", "--interval", "0.1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert cause in screen.stdout
    time.sleep(1.5)  # the crash loop respawned it every 0.1 s doubling: several times by now
    log = gov.log.read_text()
    assert log.count("event=worker_spawned") == 1, log
    said = [line for line in log.splitlines() if "proc=worker" in line and "level=ERROR" in line]
    assert len(said) == 1 and cause in said[0] and "event=start_failed" in said[0]


def test_a_governor_stopped_while_its_worker_loads_stops_at_once(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--engine", "gpt2", "--model", "random-tiny"), wait_ready=False)
    gov.wait_until(lambda: "event=worker_spawned" in gov.log.read_text(), what="the worker spawned")
    time.sleep(0.3)  # importing torch: seconds
    started = time.monotonic()
    assert gov.stop() == 0
    log = gov.log.read_text()
    assert "terminate_timeout" not in log and time.monotonic() - started < 4.0, log
    assert "event=worker_ready" in log or "reason=stopped_while_loading" in log


def test_ready_is_logged_once_the_worker_is_up_and_a_plain_reload_warns_of_nothing(
    start_governor: Start, tmp_path: Path
) -> None:
    config = tmp_path / "governor.toml"
    config.write_text("max_inflight = 8\n")  # no endpoints: the worker is spawned
    gov = start_governor("--config", str(config), "--", "--engine", "echo")
    gov.wait_until(lambda: "event=ready" in gov.log.read_text(), what="the ready line")
    (ready,) = [line for line in gov.log.read_text().splitlines() if "event=ready" in line]
    assert f"ndjson=127.0.0.1:{gov.port}" in ready and "endpoints_up=1" in ready
    config.write_text("max_inflight = 4\n")
    gov.proc.send_signal(signal.SIGHUP)
    gov.wait_until(lambda: gov.stats()["max_inflight"] == 4, what="reload")
    gov.wait_until(lambda: "event=reloaded" in gov.log.read_text(), what="the reload logged")
    assert "level=WARNING" not in gov.log.read_text()
