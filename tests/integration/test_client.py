"""governor.client against a real governor and echo worker: results, streams, pipelining,
yields and retries, cancellation by leaving a stream, auth, a lost connection."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from governor.client import (
    NO_RETRY,
    AsyncClient,
    Client,
    ConnectionLost,
    RetryPolicy,
    Token,
    Yielded,
)
from govwire.errors import BadFrame, WorkerLost
from tests.integration.conftest import Governor

pytestmark = pytest.mark.integration
Start = Callable[..., Governor]


def test_tenant_and_priority_go_in_the_frame_only_when_given() -> None:
    """Both clients, and `governor send`, against a loopback stand-in that records each frame."""
    frames: list[dict[str, Any]] = []
    connections: list[asyncio.Task[None]] = []
    done = {"status": "done", "text": "", "finish_reason": "length", "prompt_tokens": 1, "completion_tokens": 0}

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(cast(asyncio.Task[None], asyncio.current_task()))
        try:
            while line := await reader.readline():
                frames.append(orjson.loads(line))
                writer.write(orjson.dumps({"id": frames[-1]["id"], **done}) + b"\n")
        finally:
            writer.close()

    def blocking(port: int) -> None:
        with Client(port=port) as client:
            client.generate("x", tenant="B")
        argv = ["governor", "send", "x", "--address", f"127.0.0.1:{port}", "--tenant", "C", "--priority", "standard"]
        sent = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=30)
        assert sent.returncode == 0, sent.stderr

    async def scenario() -> None:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            async with AsyncClient(port=port) as aio:
                await aio.generate("x", tenant="A", priority="critical")
                await aio.generate("x")
                aio.submit("x", lambda *_: None, priority="sheddable", max_new_tokens=1)
            await asyncio.gather(*connections)  # every frame read, in order, before the next client's
            await asyncio.to_thread(blocking, port)
            await asyncio.gather(*connections)

    asyncio.run(scenario())
    # (`send` asks `stats` first, whether a worker is up: this stand-in answers it with a `done`,
    # which it takes as "no governor to wait on")
    assert [f["op"] for f in frames if f.get("op") != "generate"] == ["stats"]
    frames[:] = [f for f in frames if f.get("op") == "generate"]
    named = [(f.get("tenant"), f.get("priority")) for f in frames]
    assert named == [("A", "critical"), (None, None), (None, "sheddable"), ("B", None), ("C", "standard")]
    assert "tenant" not in frames[1] and "priority" not in frames[3]


def test_generate_stream_and_typed_errors(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "5"))
    with Client(port=gov.port) as client:
        result = client.generate("hello", max_new_tokens=16)
        assert (result.text, result.finish_reason, result.completion_tokens) == ("hello", "eos", 5)
        assert result.reply["total_ms"] >= result.reply["ttft_ms"] > 0
        stream = client.stream("abc", max_new_tokens=6, stop_on_eos=False)
        assert [t.text for t in stream] == list("abcabc")
        assert stream.result is not None and stream.result.finish_reason == "length"
        with pytest.raises(BadFrame, match="max_new_tokens"):
            client.generate("x", max_new_tokens=0)
        assert client.ping()["status"] == "pong"
        assert client.stats()["executed_total"] == 2


def test_interleaved_streams_share_one_connection(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "10"))
    with Client(port=gov.port) as client:
        first = client.stream("aaaa", max_new_tokens=4)
        second = client.stream("bbbb", max_new_tokens=4)
        texts: dict[str, str] = {"a": "", "b": ""}
        for a, b in zip(first, second, strict=True):
            texts["a"] += a.text
            texts["b"] += b.text
        assert texts == {"a": "aaaa", "b": "bbbb"}
        assert gov.stats()["connections"] == 2  # this client's one, and the stats probe's


def test_a_yield_is_raised_or_retried_after_its_hint(start_governor: Start) -> None:
    gov = start_governor("--max-inflight", "1", worker_args=("--token-delay-ms", "100"))
    with Client(port=gov.port, retry=NO_RETRY) as holder, Client(port=gov.port, retry=NO_RETRY) as other:
        held = holder.stream("hold", max_new_tokens=4, stop_on_eos=False)  # ~0.4 s in the only slot
        assert isinstance(next(held), Token)
        with pytest.raises(Yielded) as info:
            other.generate("x")
        assert info.value.reason == "inflight" and info.value.retry_hint_ms > 0
        patient = Client(port=gov.port, retry=RetryPolicy(max_attempts=50, deadline_s=10, budget_reserve=50))
        with patient:
            started = time.monotonic()
            assert patient.generate("ok", max_new_tokens=2).text == "ok"  # admitted once the slot frees
            assert time.monotonic() - started > 0.1
        list(held)
    assert gov.stats()["yielded_total"] >= 2


def test_leaving_a_stream_cancels_the_request_on_the_server(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "20"))
    with Client(port=gov.port) as client:
        for token in client.stream("x", max_new_tokens=1000, stop_on_eos=False):
            assert token.index == 0
            break
        gov.wait_until(lambda: gov.stats()["inflight"] == 0, timeout=5, what="the cancel")
        assert client.generate("still", max_new_tokens=8).text == "still"  # the connection is fine
    stats = gov.stats()
    assert stats["executed_total"] == 2 and stats["failed_total"] == 0  # cancelled ones end in done


def test_async_client_runs_many_tasks_on_one_connection_and_cancels_on_task_cancel(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "5"))

    async def scenario() -> None:
        async with AsyncClient(port=gov.port) as client:
            results = await asyncio.gather(*(client.generate(f"p{i}", max_new_tokens=8) for i in range(20)))
            assert [r.text for r in results] == [f"p{i}" for i in range(20)]
            tokens = [t.text async for t in client.stream("xyz", max_new_tokens=3, stop_on_eos=False)]
            assert tokens == ["x", "y", "z"]

            async def long() -> None:
                async with client.stream("z", max_new_tokens=1000, stop_on_eos=False) as stream:
                    async for _ in stream:
                        pass

            task = asyncio.create_task(long())
            await asyncio.sleep(0.2)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if (await client.stats())["inflight"] == 0:
                    break
                await asyncio.sleep(0.05)
            assert (await client.stats())["inflight"] == 0

    asyncio.run(scenario())
    assert gov.stats()["connections"] == 1


def test_a_lost_worker_and_a_lost_connection_surface_as_typed_errors(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "50"))
    (worker,) = gov.stats()["workers"]
    with Client(port=gov.port) as client:
        stream = client.stream("x", max_new_tokens=100, stop_on_eos=False)
        next(stream)
        os.kill(worker["pid"], signal.SIGKILL)
        with pytest.raises(WorkerLost):
            list(stream)
        gov.proc.send_signal(signal.SIGKILL)
        gov.proc.wait(10)
        with pytest.raises((ConnectionLost, OSError)):
            client.generate("y")


def test_a_client_with_a_token_authenticates(start_governor: Start, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("let-me-in-please")
    gov = start_governor("--auth-token-file", str(token_file))
    with Client(port=gov.port, token="let-me-in-please") as client:
        assert client.generate("hi", max_new_tokens=2).text == "hi"
    with pytest.raises(PermissionError):
        Client(port=gov.port, token="wrong-token")

    async def scenario() -> str:
        async with AsyncClient(port=gov.port, token="let-me-in-please") as client:
            return (await client.generate("async", max_new_tokens=5)).text

    assert asyncio.run(scenario()) == "async"


def test_status_and_print_config_commands(start_governor: Start, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("status-token")
    gov = start_governor("--auth-token-file", str(token_file), "--max-inflight", "5")
    with Client(port=gov.port, token="status-token") as client:
        client.generate("hi", max_new_tokens=2)
    base = [sys.executable, "-m", "governor"]
    address = f"127.0.0.1:{gov.port}"
    status = subprocess.run(
        [*base, "status", "--address", address, "--auth-token-file", str(token_file), "--interval", "0.2"],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    assert "governor: serving, 0/5 in flight" in status.stdout
    assert "workers: 1/1 up" in status.stdout and "executed 1" in status.stdout
    refused = subprocess.run(
        [*base, "status", "--address", f"127.0.0.1:{gov.port}"], capture_output=True, text=True, timeout=30
    )
    assert refused.returncode == 1 and "unauthorized" in refused.stderr
    printed = subprocess.run(
        [*base, "serve", "--max-inflight", "7", "--print-config"],
        capture_output=True, text=True, timeout=30, check=True, env={**os.environ, "GOVERNOR_MAX_QPS": "12.5"},
    )  # fmt: skip
    assert "max_inflight = 7  # flag" in printed.stdout and "max_qps = 12.5  # env" in printed.stdout


def test_after_a_close_open_streams_fail_and_new_requests_get_fresh_ids(start_governor: Start) -> None:
    gov = start_governor(worker_args=("--token-delay-ms", "20"))
    client = Client(port=gov.port)
    old = client.stream("aaaa", max_new_tokens=50, stop_on_eos=False)
    assert next(old).text == "a"
    client.close()
    fresh = client.stream("bbbb", max_new_tokens=4)  # reconnects; its id differs from old's
    with pytest.raises(ConnectionLost):
        next(old)  # never the fresh stream's tokens
    assert "".join(t.text for t in fresh) == "bbbb"
    old.close()  # the old request is gone with its connection: nothing to cancel on the new one
    assert client.generate("cccc", max_new_tokens=4).text == "cccc"
    client.close()
    gov.wait_until(lambda: gov.stats()["inflight"] == 0, what="everything settled")
    assert gov.stats()["failed_by_reason"]["client_disconnected"] == 1


def test_bench_authenticates_with_a_token_file(start_governor: Start, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("bench-token")
    gov = start_governor("--auth-token-file", str(token_file))
    bench = [sys.executable, "-m", "governor", "bench", "--address", f"127.0.0.1:{gov.port}", "--num-requests", "5"]
    done = subprocess.run([*bench, "--auth-token-file", str(token_file)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "Requests (accepted, done) 5" in done.stdout, done.stderr
    refused = subprocess.run(bench, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "a connection must open with" in refused.stderr  # no traceback


def test_clients_and_send_take_one_address_tcp_or_unix(tmp_path: Path) -> None:
    """`--address` (and Client(address=)) reach anything that speaks the protocol, here a worker
    on a unix socket, as `bench --address` and `--worker` do; a bad one is named, not a traceback."""
    path = tmp_path / "worker.sock"
    argv = [sys.executable, "-m", "worker", "serve", "--listen", f"unix:{path}", "--engine", "echo"]
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        worker = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:  # the socket file appears at bind, a moment before listen
            try:
                client = Client(address=f"unix:{path}")
                break
            except OSError:
                assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
        with client:
            assert (client.host, client.port) == ("", 0)
            assert client.generate("over unix", max_new_tokens=16).text == "over unix"
        base = [sys.executable, "-m", "governor", "send"]
        sent = subprocess.run([*base, "--address", f"unix:{path}", "hello"], capture_output=True, text=True, timeout=30)
        assert sent.returncode == 0 and sent.stdout == "hello\n", sent.stderr
        bad = subprocess.run([*base, "--address", "no-port", "x"], capture_output=True, text=True, timeout=30)
        assert bad.returncode == 1 and "--address" in bad.stderr and "Traceback" not in bad.stderr
        missing = tmp_path / "nothing.sock"
        gone = subprocess.run([*base, "--address", f"unix:{missing}", "x"], capture_output=True, text=True, timeout=30)
        assert gone.returncode == 1 and f"unix:{missing}" in gone.stderr and "Traceback" not in gone.stderr
    finally:
        worker.terminate()
        try:
            worker.wait(15)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
