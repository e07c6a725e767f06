"""A real third-party OpenAI-compatible server, `transformers serve` (transformers' own FastAPI app),
on a loopback port and the CPU, serving a model directory the tests saved (the tiny GPT-2 of
`tests.tiny_gpt2`): an upstream the governor can front that was not written for these tests.

Needs `transformers[serving]` (fastapi, uvicorn, openai). What the server does, as measured with
transformers 5.23.0 on the CPU:
- healthy about 7 s after the start (imports, then the model loads before uvicorn listens);
- `/v1/completions` streams `data: {json}` events whose last one carries `finish_reason` and
  `usage` (whatever `stream_options` says), with no `data: [DONE]` after it; `top_k` is answered 422,
  `n`, `best_of`, `echo`, `logprobs`, `stream_options` are ignored; `temperature`, `top_p` do not make a
  model whose generation config is greedy (GPT-2's) sample; `seed` reseeds torch process-wide;
- without `max_tokens` it generates up to 1024 tokens, past the tiny GPT-2's 128 positions: a 500
  (or, streaming, a `data: {"error": ...}` event after a 200), so always send `max_tokens`;
- `/v1/chat/completions` needs a chat template, which the tiny GPT-2 has not (a 500);
- requests are generated one at a time (one inference thread per model) unless
  `--continuous-batching` is passed, but a waiting stream gets its 200 and headers at once;
- the `model` field must be the exact string the server was started with (`TransformersServe.model`),
  or absent; the responses name it `<that string>@main`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NoReturn

import httptools

from tests.redis_server import free_port


class TransformersServe:
    """`start()` runs `transformers serve MODEL_DIR` on `port` (a free one by default) and waits for
    `GET /health`; `kill()` SIGKILLs it (a crashed upstream), `stop()` ends it politely, and
    `restart()` serves the same port again. Its output goes to a temporary file, quoted when it
    fails to start (`output_tail()`)."""

    def __init__(self, model_dir: Path | str, port: int = 0, extra_args: Sequence[str] = ()) -> None:
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.extra_args = tuple(extra_args)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._hub_cache: tempfile.TemporaryDirectory[str] | None = None

    @property
    def model(self) -> str:
        """What requests must send as `model`: the server is pinned to the model it was started
        with and answers 400 to any other name (it also accepts a request without the field)."""
        return self.model_dir

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def base_url(self) -> str:
        """The OpenAI API root, as `openai.OpenAI(base_url=...)` takes it."""
        return f"{self.url}/v1"

    def argv(self) -> list[str]:
        # `python -m transformers.cli.transformers` is the `transformers` console script, run by
        # this interpreter so that it needs nothing on the PATH.
        return [
            sys.executable,
            "-m",
            "transformers.cli.transformers",
            "serve",
            self.model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            "cpu",
            *self.extra_args,
        ]

    def env(self) -> dict[str, str]:
        assert self._hub_cache is not None
        env = dict(os.environ)
        env.update(
            # `GET /v1/models` lists the models in the Hugging Face cache (not the served one), and
            # answers 500 where there is no cache directory: an empty one of its own makes it `[]`.
            HF_HUB_CACHE=self._hub_cache.name,
            HF_HUB_OFFLINE="1",  # a local directory: never ask the Hub
            HF_HUB_DISABLE_UPDATE_CHECK="1",  # the CLI asks PyPI for a newer transformers otherwise
            HF_HUB_DISABLE_TELEMETRY="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONUNBUFFERED="1",
        )
        return env

    def start(self, timeout: float = 120.0) -> TransformersServe:
        if self.alive():
            raise RuntimeError(f"transformers serve is already running on port {self.port}")
        self._cleanup()
        self._log = tempfile.TemporaryFile(prefix="transformers-serve-")
        self._hub_cache = tempfile.TemporaryDirectory(prefix="transformers-serve-hub-")
        self.proc = subprocess.Popen(
            self.argv(), stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=self.env()
        )
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None:
                self._fail(f"transformers serve exited with {self.proc.returncode} before it was healthy")
            if time.monotonic() > deadline:
                self.kill()
                self._fail(f"transformers serve was not healthy on port {self.port} within {timeout:.0f} s")
            time.sleep(0.1)
        return self

    def _fail(self, why: str) -> NoReturn:
        output = self.output_tail()
        self.stop()  # reaps the process and removes the temporary files, which nothing else would
        raise RuntimeError(f"{why}:\n{output}")

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                return bool(response.status == 200)
        except (OSError, urllib.error.URLError):  # refused, reset, timed out, or 503
            return False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def kill(self) -> None:
        """SIGKILL, as a crash would end it: open streams are cut without a last event (httpx raises
        `httpx.RemoteProtocolError`, the openai SDK `openai.APIConnectionError`)."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (uvicorn's graceful shutdown: open streams run to their end), then SIGKILL after
        `timeout` seconds."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        self._cleanup()

    def restart(self, timeout: float = 120.0) -> TransformersServe:
        """Stop the server if it still runs (killing it if `stop` would hang), then start it on the same port."""
        self.stop()
        return self.start(timeout)

    def output_tail(self, max_bytes: int = 4000) -> str:
        """The end of what the server wrote (stdout and stderr together) since it last started. A
        request's traceback is logged just after its 500 was sent: poll for it."""
        if self._log is None:
            return ""
        self._log.flush()
        size = self._log.seek(0, os.SEEK_END)
        self._log.seek(max(0, size - max_bytes))
        return self._log.read().decode(errors="replace")

    def _cleanup(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._hub_cache is not None:
            self._hub_cache.cleanup()
            self._hub_cache = None

    def __enter__(self) -> TransformersServe:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RequestCountingRelay:
    """Forwards a loopback port to an HTTP server and counts, with httptools on both directions,
    how many `POST .../completions` requests the server holds at once: from the request's first
    byte to the end of its response (or its connection). `peak` is the most ever held: what the
    server saw, whatever the client side believes."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self._lock = threading.Lock()
        self.open = 0
        self.peak = 0
        self.total = 0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()  # the server is down: the client sees the connection refused
                continue
            _Exchange(self, client, server).start()

    def _changed(self, delta: int) -> None:
        with self._lock:
            self.open += delta
            if delta > 0:
                self.total += 1
                self.peak = max(self.peak, self.open)

    def close(self) -> None:
        self._closed = True
        self._listener.close()


class _Exchange:
    """One relayed connection: requests parsed on the way in, responses on the way out."""

    def __init__(self, relay: RequestCountingRelay, client: socket.socket, server: socket.socket) -> None:
        self.relay = relay
        self.client, self.server = client, server
        self.pending: list[bool] = []  # per request in order: is it a completion?
        self._url = b""
        self.requests = httptools.HttpRequestParser(self._RequestSide(self))
        self.responses = httptools.HttpResponseParser(self._ResponseSide(self))
        self._lock = threading.Lock()

    class _RequestSide:
        def __init__(self, exchange: _Exchange) -> None:
            self.exchange = exchange
            self.url = b""

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_headers_complete(self) -> None:
            counted = self.url.endswith(b"/completions")
            self.url = b""
            with self.exchange._lock:
                self.exchange.pending.append(counted)
            if counted:
                self.exchange.relay._changed(+1)

    class _ResponseSide:
        def __init__(self, exchange: _Exchange) -> None:
            self.exchange = exchange

        def on_message_complete(self) -> None:
            with self.exchange._lock:
                counted = self.exchange.pending.pop(0) if self.exchange.pending else False
            if counted:
                self.exchange.relay._changed(-1)

    def start(self) -> None:
        threading.Thread(target=self._pipe, args=(self.client, self.server, self.requests), daemon=True).start()
        threading.Thread(target=self._pipe, args=(self.server, self.client, self.responses), daemon=True).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, parser: Any) -> None:
        try:
            while data := source.recv(65536):
                parser.feed_data(data)
                sink.sendall(data)
        except (OSError, httptools.HttpParserError):
            pass
        finally:
            for sock in (source, sink):  # shutdown, not only close: it wakes the other direction's recv
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            with self._lock:
                cut, self.pending = sum(self.pending), []
            if cut:
                self.relay._changed(-cut)
