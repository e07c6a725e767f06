"""Tokenizers the engine can use, and incremental detokenization for streaming."""

from __future__ import annotations

import copy
from typing import Any, Protocol


def default_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The prompt a chat becomes for a model whose tokenizer has no chat template (GPT-2 has
    none): one line per message, `Role: content`, then `Assistant:` for the model to go on from."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int  # ids it can produce: 0 .. vocab_size - 1

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """A chat's messages as the prompt text this model expects."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def clone(self) -> Tokenizer:
        """An instance another thread may use at the same time as this one."""
        ...


class ByteTokenizer:
    """A tokenizer that needs no files, for the random-weight models: one token per UTF-8 byte.

    Ids 0-255 are bytes and `eos_token_id` is end-of-text (it decodes to nothing). A model's
    vocabulary is larger (GPT-2's has 50,257 ids): an id above 255 decodes to the byte `id % 256`,
    so whatever a random model samples is still printable text.
    """

    def __init__(self, vocab_size: int, eos_token_id: int) -> None:
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return default_chat_prompt(messages)

    def decode(self, ids: list[int]) -> str:
        eos = self.eos_token_id
        return bytes(i & 0xFF for i in ids if i != eos).decode("utf-8", errors="replace")

    def clone(self) -> ByteTokenizer:
        return self  # no state: safe from any number of threads


class HFTokenizer:
    """A transformers tokenizer (`AutoTokenizer.from_pretrained`) behind the engine's interface."""

    def __init__(self, tokenizer: Any) -> None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has no end-of-sequence token")
        self._tokenizer = tokenizer
        self.eos_token_id: int = tokenizer.eos_token_id
        self.vocab_size = len(tokenizer)  # added tokens included

    def encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """By the checkpoint's own chat template when it has one (`tokenizer_config.json`'s
        `chat_template`), as transformers and vLLM do; else `default_chat_prompt`."""
        if getattr(self._tokenizer, "chat_template", None):
            text = self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return str(text)
        return default_chat_prompt(messages)

    def decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))

    def clone(self) -> HFTokenizer:
        # A fast tokenizer's Rust object is not safe to use from two threads at once ("Already
        # borrowed"); a deep copy has its own.
        return HFTokenizer(copy.deepcopy(self._tokenizer))


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces that never split a character.

    text-generation-inference's `decode_token` technique: decode a window (the previously emitted
    token for context, then the unread ones) with and without the unread ones, and emit the
    difference once it no longer ends in U+FFFD (an incomplete character). Held-back text comes
    out with the token that completes it, or from `flush` at the end.
    """

    __slots__ = ("_tokenizer", "_ids", "_prefix", "_read")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the context window
        self._read = 0  # first id whose text was not emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read])
        text = decode(self._ids[self._prefix :])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end decodes as U+FFFD)."""
        decode = self._tokenizer.decode
        prefix_text = decode(self._ids[self._prefix : self._read])
        text = decode(self._ids[self._prefix :])
        self._read = len(self._ids)
        return text[len(prefix_text) :]
