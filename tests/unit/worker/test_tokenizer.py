"""Incremental detokenization: streamed pieces never split a character and add up to the text."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from worker.loading import load_hf_model
from worker.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    Tokenizer,
    bytes_to_unicode,
    default_chat_prompt,
)

BYTES = ByteTokenizer(vocab_size=257, eos_token_id=256)
# Bytes that start and continue multi-byte characters (é, あ, 🙂), ones that start what can never be
# one (a surrogate: ED A0-BF; overlong: E0 80-9F; past U+10FFFF: F4 90-BF), and stray ones:
# uniformly random bytes would rarely make a character, whole or split.
MULTIBYTE = [0xC3, 0xA9, 0xE3, 0x81, 0x82, 0xF0, 0x9F, 0x99, 0x82, 0x80, 0xBF, 0xC0, 0xF5, 0xFF, 0xED, 0xA0, 0xE0, 0xF4]


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


def test_a_surrogate_comes_out_as_replacements_as_soon_as_its_second_byte_shows_it() -> None:
    # CPython's incremental decoder alone would hold ED A0 until a third byte.
    assert stream(BYTES, [0xED, 0xA0, 0x80, 0x61]) == ["", "\ufffd\ufffd", "\ufffd", "a", ""]
    assert BYTES.decode([0xED, 0xA0]) == "\ufffd\ufffd"


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


def assert_streams_exactly(tokenizer: Tokenizer, ids: list[int]) -> None:
    """The pieces add up to `decode(ids)`, and each comes as soon as it can: after every push what
    came out is everything `decode` of the ids so far gives, less at most one trailing U+FFFD (an
    incomplete character, held back)."""
    detokenizer = IncrementalDetokenizer(tokenizer)
    out = ""
    for k, token_id in enumerate(ids, 1):
        out += detokenizer.push(token_id)
        so_far = tokenizer.decode(ids[:k])
        assert so_far in (out, out + "\ufffd")
    out += detokenizer.flush()
    assert out == tokenizer.decode(ids)


def id_lists(vocab: int, eos: int, split: Sequence[int]) -> st.SearchStrategy[list[int]]:
    return st.lists(st.one_of(st.integers(0, vocab - 1), st.just(eos), st.sampled_from(split)), max_size=40)


@settings(max_examples=200)
@given(id_lists(257, 256, MULTIBYTE))
def test_byte_tokens_stream_exactly_what_decode_gives(ids: list[int]) -> None:
    assert_streams_exactly(BYTES, ids)


GPT2_SIZED = ByteTokenizer(vocab_size=50257, eos_token_id=50256)  # random-gpt2: ids above 255 are `id % 256`


@settings(max_examples=100)
@given(id_lists(50257, 50256, [b + 256 * k for b in MULTIBYTE for k in (0, 7, 195)]))
def test_byte_tokens_of_a_large_vocabulary_stream_exactly(ids: list[int]) -> None:
    assert_streams_exactly(GPT2_SIZED, ids)


@pytest.fixture(scope="module")
def bpe(tiny_gpt2_dir: Path) -> HFTokenizer:
    return HFTokenizer(AutoTokenizer.from_pretrained(str(tiny_gpt2_dir)))


@pytest.fixture(scope="module")
def bpe_added(tiny_gpt2_dir: Path) -> HFTokenizer:
    """The tiny BPE with added tokens: ones outside the byte map (" foo", "日本"), ones spelt in it
    ("Ġbar" is " bar", "Ã©" is "é"; as `decode` has them too), and another special one."""
    hf = AutoTokenizer.from_pretrained(str(tiny_gpt2_dir))
    hf.add_tokens([" foo", "日本", "Ġbar", "Ã©"])
    hf.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    return HFTokenizer(hf)


def byte_token_ids(tokenizer: HFTokenizer) -> list[int]:
    """The ids of the BPE's single-byte tokens for MULTIBYTE."""
    to_id = tokenizer._tokenizer.convert_tokens_to_ids
    byte_chars = bytes_to_unicode()
    return [int(to_id(byte_chars[b])) for b in MULTIBYTE]


@settings(max_examples=200)
@given(data=st.data())
def test_a_byte_level_bpe_streams_exactly_what_decode_gives(bpe: HFTokenizer, data: st.DataObject) -> None:
    # Past the vocabulary too: transformers' decode drops an id it has no token for, and so do we.
    ids = data.draw(id_lists(bpe.vocab_size + 3, bpe.eos_token_id, byte_token_ids(bpe)))
    assert_streams_exactly(bpe, ids)


@settings(max_examples=100)
@given(data=st.data())
def test_added_and_special_tokens_stream_as_decode_has_them(bpe_added: HFTokenizer, data: st.DataObject) -> None:
    added = list(range(bpe_added.vocab_size - 5, bpe_added.vocab_size))
    ids = data.draw(id_lists(bpe_added.vocab_size, bpe_added.eos_token_id, [*byte_token_ids(bpe_added), *added]))
    assert_streams_exactly(bpe_added, ids)


def test_added_tokens_decode_through_the_byte_map_only_when_spelt_in_it(bpe_added: HFTokenizer) -> None:
    ids = bpe_added.encode("a foo日本")
    assert bpe_added.decode(ids) == "a foo日本"
    to_id = bpe_added._tokenizer.convert_tokens_to_ids
    assert bpe_added.decode([to_id("Ġbar"), to_id("Ã©"), to_id("<|im_end|>")]) == " baré"
    table = bpe_added.token_bytes()
    assert table is not None
    assert [table[to_id(t)] for t in [" foo", "日本", "Ġbar", "Ã©", "<|im_end|>"]] == [
        b" foo",
        "日本".encode(),
        b" bar",
        "é".encode(),
        b"",
    ]


@settings(max_examples=100)
@given(st.text(max_size=40))
def test_bpe_tokens_of_any_text_stream_back_unbroken(bpe: HFTokenizer, text: str) -> None:
    pieces = stream(bpe, bpe.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


def test_byte_level_tokenizers_take_the_table_path(bpe: HFTokenizer) -> None:
    table = BYTES.token_bytes()
    assert table[0x41] == b"A" and table[256] == b""
    assert GPT2_SIZED.token_bytes()[0x141] == b"A"
    bpe_table = bpe.token_bytes()
    assert bpe_table is not None and len(bpe_table) == bpe.vocab_size
    assert bpe_table[bpe.eos_token_id] == b""
    twin = bpe.clone()
    assert twin.token_bytes() is bpe_table  # computed once, shared with clones
    assert twin._tokenizer is not bpe._tokenizer


def word_level_tokenizer() -> HFTokenizer:
    """A tokenizer that is not byte-level: whole words, no decoder (decode joins tokens with spaces)."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import models, pre_tokenizers

    vocab = {"<eos>": 0, "[UNK]": 1, "the": 2, "café": 3, "日本": 4, "🙂": 5, ",": 6, "fox": 7}
    words = RustTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return HFTokenizer(PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="[UNK]"))


WORDS = word_level_tokenizer()


@settings(max_examples=200)
@given(id_lists(WORDS.vocab_size, WORDS.eos_token_id, [0]))
def test_a_tokenizer_that_is_not_byte_level_falls_back_to_windows(ids: list[int]) -> None:
    assert WORDS.token_bytes() is None
    assert_streams_exactly(WORDS, ids)


class WithoutTable:
    """A tokenizer's decode without its bytes table (so the fallback runs), recording the longest
    list of ids it was asked to decode."""

    def __init__(self, inner: ByteTokenizer) -> None:
        self.inner = inner
        self.eos_token_id = inner.eos_token_id
        self.vocab_size = inner.vocab_size
        self.longest = 0

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.inner.render_chat(messages)

    def decode(self, ids: list[int]) -> str:
        self.longest = max(self.longest, len(ids))
        return self.inner.decode(ids)

    def token_bytes(self) -> None:
        return None

    def clone(self) -> WithoutTable:
        return self


@given(st.text(max_size=40))
def test_the_fallback_streams_any_text_back_unbroken(text: str) -> None:
    tokenizer = WithoutTable(BYTES)
    pieces = stream(tokenizer, tokenizer.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces) or "\ufffd" in text


@pytest.mark.parametrize("token_id", [0xE3, 256])  # a window that ends in U+FFFD; ids that add no text
def test_the_fallback_window_stays_bounded_when_it_never_closes(token_id: int) -> None:
    tokenizer = WithoutTable(BYTES)
    ids = [0x61, *[token_id] * 256, 0x62]
    assert "".join(stream(tokenizer, ids)) == BYTES.decode(ids)
    assert tokenizer.longest <= 2 * IncrementalDetokenizer.MAX_PENDING
