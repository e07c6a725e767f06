"""Incremental detokenization: streamed pieces never split a character and add up to the text."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoTokenizer

from worker.loading import load_hf_model
from worker.tokenizer import ByteTokenizer, HFTokenizer, IncrementalDetokenizer, Tokenizer, default_chat_prompt

BYTES = ByteTokenizer(vocab_size=257, eos_token_id=256)


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    pieces = [detokenizer.push(i) for i in ids]
    pieces.append(detokenizer.flush())
    return pieces


def test_a_multibyte_character_arrives_whole_with_its_last_byte() -> None:
    assert stream(BYTES, list("aé🙂".encode())) == ["a", "", "é", "", "", "", "🙂", ""]


@given(st.text(max_size=40))
def test_byte_tokens_of_any_text_stream_back_unbroken(text: str) -> None:
    pieces = stream(BYTES, BYTES.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_an_incomplete_character_at_the_end_is_flushed_as_a_replacement() -> None:
    assert stream(BYTES, [0x61, 0xE2, 0x82]) == ["a", "", "", "\ufffd"]


def test_end_of_text_decodes_to_nothing() -> None:
    assert BYTES.decode([0x68, 256, 0x69]) == "hi"
    assert BYTES.encode("hi") == [0x68, 0x69]


def test_a_byte_level_bpe_tokenizer_streams_unbroken(tiny_gpt2_dir: Path) -> None:
    _, tokenizer = load_hf_model(str(tiny_gpt2_dir))
    text = "naïve café, Straße, 日本語のテキスト, emoji 🙂 and ünïcödé: the quick brown fox"
    ids = tokenizer.encode(text)
    pieces = stream(tokenizer, ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces)  # some token did end inside a character


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]


def test_a_chat_without_a_template_gets_the_documented_default() -> None:
    assert BYTES.render_chat(CHAT) == "System: Be brief.\nUser: Hello\nAssistant:"


def test_a_chat_template_in_the_checkpoint_is_used(tiny_gpt2_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(str(tiny_gpt2_dir))
    assert HFTokenizer(hf).render_chat(CHAT) == default_chat_prompt(CHAT)  # GPT-2 has none
    hf.chat_template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    assert HFTokenizer(hf).render_chat(CHAT) == "<|system|>Be brief.<|user|>Hello<|assistant|>"
