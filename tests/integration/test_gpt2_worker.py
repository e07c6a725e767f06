"""The real governor in front of a real GPT-2 worker process (a tiny checkpoint saved by the test)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from benchmarks.harness.fixtures.tiny_gpt2 import N_POSITIONS, hf_greedy
from govwire.codec import encode, generate_frame
from tests.integration.conftest import Conn, Governor, Worker
from worker.loading import load_hf_model

pytestmark = pytest.mark.integration

Start = Callable[..., Governor]


def gpt2_governor(start_governor: Start, model_dir: Path, *flags: str, worker_flags: tuple[str, ...] = ()) -> Governor:
    # float32 pinned: on a CPU with native bfloat16, --dtype auto picks bfloat16, whose greedy
    # tokens may differ from transformers' float32 ones at near-ties (docs/benchmarks/sittings.md, dtypes).
    worker_args = ("--engine", "gpt2", "--model", str(model_dir), "--device", "cpu", "--dtype", "float32")
    return start_governor(*flags, worker_args=(*worker_args, "--stats-interval-s", "0.1", *worker_flags))


def worker(gov: Governor, name: str) -> float:
    """A governor_worker_* metric, summed over workers."""
    return sum(v for (metric, _), v in gov.metrics().items() if metric == f"governor_worker_{name}")


def test_streamed_greedy_tokens_equal_hf_generate(start_governor: Start, tiny_gpt2_dir: Path) -> None:
    gov = gpt2_governor(start_governor, tiny_gpt2_dir)
    c = gov.conn()
    prompt = "The quick brown fox, naïve café"
    c.send("g", prompt, max_new_tokens=24, temperature=0)
    replies = c.until_final("g")
    tokens, done = replies[:-1], replies[-1]
    expected = hf_greedy(load_hf_model(str(tiny_gpt2_dir)), prompt, 24)
    assert [t["token_id"] for t in tokens] == expected
    assert done["status"] == "done" and done["completion_tokens"] == len(expected)
    assert "".join(t["text"] for t in tokens) == done["text"]
    for key in ("queue_wait_ms", "prefill_ms", "worker_ttft_ms", "decode_ms", "ttft_ms"):
        assert done[key] >= 0, key
    assert done["worker_ttft_ms"] <= done["ttft_ms"] <= done["total_ms"]


def test_a_request_beyond_the_context_is_bad_frame_and_frees_its_slot(
    start_governor: Start, tiny_gpt2_dir: Path
) -> None:
    gov = gpt2_governor(start_governor, tiny_gpt2_dir)
    c = gov.conn()
    c.send("long", "hello", max_new_tokens=N_POSITIONS)
    (reply,) = c.until_final("long")
    assert reply["code"] == "bad_frame" and f"context of {N_POSITIONS} tokens" in reply["message"]
    stats = gov.stats()
    assert stats["inflight"] == 0 and stats["rejected_by_reason"]["bad_frame"] == 1
    c.send("ok", "hello", max_new_tokens=3, stop_on_eos=False)
    assert c.until_final("ok")[-1]["completion_tokens"] == 3
    c.send("empty", "", max_new_tokens=3)
    (reply,) = c.until_final("empty")
    assert reply["code"] == "bad_frame" and "prompt is empty" in reply["message"]
    assert gov.stats()["inflight"] == 0


def test_a_cancel_with_an_unusable_id_does_not_break_the_worker_link(
    start_worker: Callable[..., Worker], tiny_gpt2_dir: Path
) -> None:
    # Spoken to the worker directly, as a governor would: the odd cancel is ignored, the link lives.
    address = start_worker("--model", str(tiny_gpt2_dir), "--device", "cpu").address
    c = Conn(int(address.rsplit(":", 1)[1]))
    try:
        c.send_raw(b'{"op": "cancel", "id": [1]}\n{"op": "cancel", "id": {"a": 1}}\n')
        c.send("g", "hello", max_new_tokens=2, stop_on_eos=False)
        replies = c.until_final("g")
        assert replies[-1]["status"] == "done" and replies[-1]["completion_tokens"] == 2
    finally:
        c.close()


def test_a_vanished_client_is_cancelled_in_the_worker(start_governor: Start, tiny_gpt2_dir: Path) -> None:
    gov = gpt2_governor(start_governor, tiny_gpt2_dir, "--integrity", "optional")
    c = gov.conn()
    max_new = N_POSITIONS - 8
    c.send("gone", "hello", max_new_tokens=max_new, stop_on_eos=False)
    assert c.recv()["status"] == "token"
    c.sock.shutdown(socket.SHUT_RDWR)
    c.close()
    gov.wait_until(lambda: worker(gov, "finished_total") == 1, what="the worker finished the cancelled request")
    assert gov.stats()["inflight"] == 0
    assert worker(gov, "running") == 0 and worker(gov, "kv_cache_used_tokens") == 0
    assert worker(gov, "generated_tokens_total") < max_new  # it stopped early, it did not run to the end


def test_engine_statistics_are_exported_as_worker_metrics_and_in_stats(
    start_governor: Start, tiny_gpt2_dir: Path
) -> None:
    gov = gpt2_governor(start_governor, tiny_gpt2_dir)
    c = gov.conn()
    for i in range(4):
        c.send(f"r{i}", "Governors keep inference workers healthy", max_new_tokens=5, stop_on_eos=False)
    finals = c.finals(4)
    assert all(f["status"] == "done" for f in finals.values())
    gov.wait_until(lambda: worker(gov, "generated_tokens_total") == 20, what="worker stats push")
    assert worker(gov, "finished_total") == 4
    assert worker(gov, "prefill_tokens_total") == 4 * finals["r0"]["prompt_tokens"]
    assert worker(gov, "kv_cache_capacity_tokens") == 16384 and worker(gov, "kv_cache_bytes") > 0
    assert 1 <= worker(gov, "step_sequences_total") / worker(gov, "steps_total") <= 4
    (linked,) = gov.stats()["workers"]
    assert linked["engine"]["generated_tokens_total"] == 20 and linked["engine"]["finished_total"] == 4


def test_prefix_hits_and_preemptions_through_the_governor_keep_greedy_outputs(
    start_governor: Start, tiny_gpt2_dir: Path
) -> None:
    # A pool of 16 blocks of 8 tokens: a shared prompt is reused, and four 60-token streams sent
    # in one write (each needs 8 blocks at its end, so any three at once overflow the pool)
    # cannot all grow at once, so some are preempted and resumed.
    gov = gpt2_governor(
        start_governor, tiny_gpt2_dir, worker_flags=("--kv-block-size", "8", "--kv-cache-tokens", "128")
    )
    hf = load_hf_model(str(tiny_gpt2_dir))
    c = gov.conn()
    system = "Governors keep inference workers healthy under bursts of traffic. "
    c.send("first", system + "The quick", max_new_tokens=4, temperature=0)
    first = c.until_final("first")[-1]
    c.send("second", system + "Continuous", max_new_tokens=4, temperature=0)
    replies = c.until_final("second")
    second = replies[-1]
    assert first["cached_prompt_tokens"] == 0 and second["cached_prompt_tokens"] >= 8
    assert [t["token_id"] for t in replies[:-1]] == hf_greedy(hf, system + "Continuous", 4)
    prompts = {f"p{i}": word for i, word in enumerate(["naïve café", "The lazy dog", "x y z", "Straße"])}
    c.send_raw(b"".join(encode(generate_frame(rid, p, max_new_tokens=60, temperature=0)) for rid, p in prompts.items()))
    streams: dict[str, list[dict[str, object]]] = {rid: [] for rid in prompts}
    while len([s for s in streams.values() if s and s[-1]["status"] != "token"]) < len(prompts):
        reply = c.recv()
        streams[str(reply["id"])].append(reply)
    for rid, prompt in prompts.items():
        tokens = streams[rid][:-1]
        assert [t["index"] for t in tokens] == list(range(len(tokens))), rid  # no gap, no repeat
        assert [t["token_id"] for t in tokens] == hf_greedy(hf, prompt, 60), rid
    gov.wait_until(lambda: worker(gov, "finished_total") == 6, what="worker stats push")
    assert worker(gov, "preemptions_total") > 0
    assert worker(gov, "prefix_cache_hits_tokens_total") == second["cached_prompt_tokens"]
    assert worker(gov, "kv_cache_usage_ratio") == 0 and worker(gov, "kv_cache_used_blocks") == 0
    assert worker(gov, "kv_cache_cached_blocks") + worker(gov, "kv_cache_free_blocks") == 16
    assert gov.stats()["inflight"] == 0
