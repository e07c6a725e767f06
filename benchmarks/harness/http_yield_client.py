"""Pipelined HTTP load client for the front door's refusal path: `benchmarks.harness.yield_client`'s
pipeline (same connections, window and batch) carrying `POST /v1/completions` requests.

Requests are pre-built bytes (request line, the headers a plain client sends, a JSON body), so the
client does no per-request encoding. Responses are split by `httptools.HttpResponseParser` (llhttp,
the parser the governor itself reads requests with), not by hand: every `on_message_complete` is one
response, and its status is read with `get_status_code()`. Everything but a 429 is counted by status
and reported, so a rate made of the wrong answers cannot pass for a refusal rate. Round trips are
measured as in yield_client: from the write of a batch to the read that completed its responses.

Prints one JSON object: responses, responses_per_s, rtt_p50_ms, rtt_p99_ms, client_cpu_share,
not_429 (status -> count, over the whole run, warm-up included).
"""

from __future__ import annotations

import argparse
import time

import httptools
import orjson
import uvloop

from benchmarks.harness.yield_client import PROMPT, Pipeline, drive

REFUSED = 429


SDK_HEADERS = (
    "X-Stainless-Lang: python\r\n"
    "X-Stainless-Package-Version: 2.52.0\r\n"
    "X-Stainless-Retry-Count: 0\r\n"
    "X-Stainless-Read-Timeout: 600\r\n"
)
"""What the openai SDK adds to every request (a first attempt's retry count), for `--sdk-headers`."""


def completion_request(model: str, prompt: str, max_tokens: int, sdk: bool = False) -> bytes:
    """One `POST /v1/completions` as a plain keep-alive client writes it (no Content-Digest: the
    door does not require one by default), with `sdk` as the openai SDK writes it."""
    body = orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens})
    head = (
        "POST /v1/completions HTTP/1.1\r\n"
        "Host: 127.0.0.1\r\n"
        "User-Agent: governor-bench/1\r\n"
        "Accept: application/json\r\n"
        "Content-Type: application/json\r\n" + (SDK_HEADERS if sdk else "") + f"Content-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class HttpPipeline(Pipeline):
    """yield_client's window and round-trip bookkeeping; replies counted by an HTTP parser."""

    def __init__(self, requests: list[bytes], batch: int, window: int) -> None:
        super().__init__(requests, batch, window)
        self.parser = httptools.HttpResponseParser(self)
        self.completed = 0
        self.not_refused: dict[int, int] = {}

    # httptools calls only the callbacks an object has: this one, once per whole response.
    def on_message_complete(self) -> None:
        self.completed += 1
        status = self.parser.get_status_code()
        if status != REFUSED:
            self.not_refused[status] = self.not_refused.get(status, 0) + 1

    def data_received(self, data: bytes) -> None:
        before = self.completed
        self.parser.feed_data(data)
        self.replied(time.perf_counter(), self.completed - before)  # Pipeline's clock


async def run(
    port: int, connections: int, seconds: float, warmup: float, batch: int, window: int, model: str, sdk: bool = False
) -> dict[str, object]:
    requests = [completion_request(model, PROMPT, 16, sdk)] * (batch * 50)
    pipes, result = await drive(port, connections, seconds, warmup, lambda: HttpPipeline(requests, batch, window))
    not_429: dict[str, int] = {}
    for pipe in pipes:
        assert isinstance(pipe, HttpPipeline)
        for status, n in pipe.not_refused.items():
            not_429[str(status)] = not_429.get(str(status), 0) + n
    return {
        "responses": result["frames"],
        "seconds": result["seconds"],
        "responses_per_s": result["frames_per_s"],
        "rtt_p50_ms": result["rtt_p50_ms"],
        "rtt_p99_ms": result["rtt_p99_ms"],
        "client_cpu_share": result["client_cpu_share"],
        "not_429": not_429,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True, help="the governor's --http-port")
    parser.add_argument("--connections", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    parser.add_argument("--batch", type=int, default=64, help="requests per write")
    parser.add_argument("--window", type=int, default=1024, help="requests in flight per connection")
    parser.add_argument("--model", default="gpt2", help="the governor's --served-model")
    parser.add_argument("--sdk-headers", action="store_true", help="the x-stainless-* headers the openai SDK sends")
    a = parser.parse_args()
    result = uvloop.run(run(a.port, a.connections, a.seconds, a.warmup, a.batch, a.window, a.model, a.sdk_headers))
    print(orjson.dumps(result).decode())


if __name__ == "__main__":
    main()
