"""benchmarks/harness/fixtures/serial_openai.py on loopback, driven by the openai SDK: one request
generates at a time and the rest wait their turn (two slots: two at once); streams end with usage
and [DONE] as OpenAI's do; a client that goes frees its slot; the server's process ends with its
parent's pipe."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import httpx
import openai

from benchmarks.harness.fixtures.serial_openai import Engine, Pace, SerialOpenAI, listen

Scenario = Callable[[openai.AsyncOpenAI, str, Engine], Awaitable[None]]


def served(scenario: Scenario, slots: int = 1) -> None:
    """Run `scenario` against a server of `slots` on loopback, with an SDK client that never retries."""

    async def main() -> None:
        server, engine = await listen(Pace(token_s=0.005, slots=slots))
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1"
        client = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        try:
            await scenario(client, url, engine)
        finally:
            await client.close()
            server.close()

    asyncio.run(main())


async def stream(client: openai.AsyncOpenAI, tokens: int) -> tuple[list[float], list[str], int | None]:
    """The arrival time of each text chunk, the texts, and the usage's completion tokens."""
    times, texts, usage = [], [], None
    response = await client.completions.create(
        model="m", prompt="a b c", max_tokens=tokens, stream=True, stream_options={"include_usage": True}
    )
    async for chunk in response:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic())
            texts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return times, texts, usage


def test_requests_generate_one_at_a_time_and_end_with_usage() -> None:
    async def scenario(client: openai.AsyncOpenAI, url: str, engine: Engine) -> None:
        (t1, texts, usage), (t2, _, _) = await asyncio.gather(stream(client, 4), stream(client, 4))
        assert texts == [" t0", " t1", " t2", " t3"] and usage == 4
        first, second = sorted([t1, t2])
        assert first[-1] <= second[0]  # the second waited for the first to end
        assert second[-1] - first[0] >= 6 * 0.005  # seven token times apart on the server; the client reads them late
        assert engine.stats() == {"completions": 2, "tokens": 8}

    served(scenario)


def test_two_slots_generate_two_at_once() -> None:
    async def scenario(client: openai.AsyncOpenAI, url: str, engine: Engine) -> None:
        (t1, _, _), (t2, _, _) = await asyncio.gather(stream(client, 4), stream(client, 4))
        assert t2[0] < t1[-1] and t1[0] < t2[-1]  # they overlap

    served(scenario, 2)


def test_a_plain_completion_health_models_and_an_unknown_path() -> None:
    async def scenario(client: openai.AsyncOpenAI, url: str, engine: Engine) -> None:
        reply = await client.completions.create(model="m", prompt="hello there", max_tokens=3)
        assert reply.choices[0].text == " t0 t1 t2" and reply.usage is not None and reply.usage.prompt_tokens == 2
        assert [m.id async for m in client.models.list()] == ["m"]
        async with httpx.AsyncClient() as http:
            root = url.removesuffix("/v1")
            assert (await http.get(f"{root}/health")).status_code == 200
            assert (await http.get(f"{root}/nowhere")).status_code == 404
            assert (await http.post(f"{url}/completions", content=b"not json")).status_code == 400

    served(scenario)


def test_a_client_that_goes_frees_its_slot_for_the_next() -> None:
    async def scenario(client: openai.AsyncOpenAI, url: str, engine: Engine) -> None:
        gone = asyncio.create_task(stream(client, 1000))  # 5 s if it ran to its end
        await asyncio.sleep(0.05)
        gone.cancel()
        started = time.monotonic()
        times, _, _ = await asyncio.wait_for(stream(client, 2), timeout=2)
        assert times[-1] - started < 1.0 and engine.stats()["completions"] == 1

    served(scenario)


def test_the_server_process_ends_when_its_parent_s_pipe_closes() -> None:
    server = SerialOpenAI(Pace()).start()
    try:
        assert server.proc is not None and server.proc.stdin is not None and server.get("/health") == {"status": "ok"}
        server.proc.stdin.close()  # what the parent's death does to it
        assert server.proc.wait(5) == 0
    finally:
        server.stop()
