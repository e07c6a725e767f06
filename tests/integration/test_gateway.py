"""The gateway contract over real sockets (doors/gateway.py): a governor process with a spawned
worker, driven with the headers a GAIE / llm-d gateway sets and read back the way the gateway
and its endpoint picker read it (headers, /metrics)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import pytest

from tests.integration.conftest import Governor
from tests.integration.test_openai_front_door import balanced, front_door

pytestmark = pytest.mark.integration

Start = Callable[..., Governor]
BODY = {"model": "gpt2", "prompt": "hello gateway", "max_tokens": 4}


def admitted_of(stats: dict[str, object], tenant: str) -> int:
    (row,) = [t for t in stats["tenants"] if t["name"] == tenant]  # type: ignore[attr-defined]
    return int(row["admitted_total"])


def test_a_gateways_headers_choose_tenant_class_and_deadline_and_its_words_come_back(start_governor: Start) -> None:
    # (--tenant-share-from 1: no fair share between team-a and everyone else, to see the cap alone)
    flags = ("--max-inflight", "2", "--tenant", "team-a", "--tenant-share-from", "1", "--objective", "chat=critical")
    flags += ("--trusted-gateway", "127.0.0.1")  # the gateway: this test, on loopback
    echo = ("--token-delay-ms", "20", "--first-token-delay-ms", "20")
    gov, port = front_door(start_governor, None, *flags, echo=echo)
    url = f"http://127.0.0.1:{port}/v1/completions"
    gateway = {"x-llm-d-inference-fairness-id": "team-a", "x-llm-d-inference-objective": "chat"}
    with httpx.Client(timeout=30) as client:
        admitted = client.post(url, json=BODY, headers={**gateway, "x-llm-d-slo-ttft-ms": "5000"})
        assert admitted.status_code == 200, admitted.text
        assert admitted.headers["x-llm-d-flow-queue-duration-ms"] == "0"
        assert admitted.headers["x-llm-d-flow-band-headroom-requests"] == "1"  # of 2 slots, itself in one
        s = gov.stats()
        assert admitted_of(s, "team-a") == 1 and s["classes"]["critical"]["admitted_total"] == 1

        def hold(started: threading.Event) -> None:  # a long stream holds a slot for ~2 s
            body = {**BODY, "max_tokens": 100, "stream": True, "ignore_eos": True}
            with client.stream("POST", url, json=body) as stream:
                assert stream.status_code == 200
                started.set()
                for _ in stream.iter_bytes():
                    pass

        holders = []

        def one_more_held() -> None:
            started = threading.Event()
            holders.append(threading.Thread(target=hold, args=(started,)))
            holders[-1].start()
            assert started.wait(30)

        for _ in range(8):  # the endpoint's TTFT model predicts from its 8th first token on
            assert client.post(url, json=BODY).status_code == 200
        one_more_held()
        # A TTL shorter than any first token here (a token takes 20 ms): refused at once, in
        # llm-d's words.
        short = client.post(url, json=BODY, headers={**gateway, "x-llm-d-inference-ttl": "1ms"})
        assert short.status_code == 429 and short.json()["error"]["reason"] == "deadline"
        assert short.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
        # Both slots held: a capacity refusal in llm-d's words, the governor's reason in the body.
        one_more_held()
        full = client.post(url, json=BODY, headers=gateway)
        assert full.status_code == 429 and full.json()["error"]["reason"] == "inflight"
        assert full.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        # What the endpoint picker scrapes: the two admitted, nothing waiting (a refusal is an answer).
        scrape = client.get(f"http://127.0.0.1:{port}/metrics").text
        assert 'vllm:num_requests_running{model_name="gpt2"} 2.0' in scrape
        assert 'vllm:num_requests_waiting{model_name="gpt2"} 0.0' in scrape
        for holder in holders:
            holder.join(30)

        # Malformed gateway headers: a 400 naming the header, and the door goes on serving.
        for header, value in (("x-llm-d-inference-ttl", "-1s"), ("x-dynamo-request-priority", "urgent")):
            bad = client.post(url, json=BODY, headers={header: value})
            assert bad.status_code == 400 and header in bad.json()["error"]["message"]
        assert client.post(url, json=BODY).status_code == 200
    s = gov.stats()
    assert s["rejected_by_reason"]["bad_frame"] == 2 and s["yielded_by_reason"]["deadline"] == 1
    balanced(gov)


def test_an_untrusted_peers_fairness_id_names_no_tenant(start_governor: Start) -> None:
    gov, port = front_door(start_governor, None, "--tenant", "team-a", "--trusted-gateway", "10.0.0.0/8")
    headers = {"x-llm-d-inference-fairness-id": "team-a"}
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY, headers=headers, timeout=30)
    assert reply.status_code == 200
    s = gov.stats()
    assert admitted_of(s, "team-a") == 0 and admitted_of(s, "default") == 1
