"""Tokenizers the engine can use, and incremental detokenization for streaming."""

from __future__ import annotations

import copy
from codecs import utf_8_decode
from collections.abc import Sequence
from typing import Any, Protocol


def default_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The prompt a chat becomes for a model whose tokenizer has no chat template (GPT-2 has
    none): one line per message, `Role: content`, then `Assistant:` for the model to go on from."""
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in messages]
    return "\n".join([*lines, "Assistant:"])


_BYTES = [bytes([b]) for b in range(256)]


class Tokenizer(Protocol):
    eos_token_id: int
    vocab_size: int  # ids it can produce: 0 .. vocab_size - 1

    def encode(self, text: str) -> list[int]: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """A chat's messages as the prompt text this model expects."""
        ...

    def decode(self, ids: list[int]) -> str: ...

    def token_bytes(self) -> Sequence[bytes] | None:
        """Each id's bytes, when `decode(ids)` is exactly the UTF-8 decoding (errors replaced by
        U+FFFD) of the concatenation of its ids' bytes; None when it is not (then streaming falls
        back to decoding windows of ids). Computed once: callers may ask per request."""
        ...

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
        self._token_bytes = tuple(b"" if i == eos_token_id else _BYTES[i & 0xFF] for i in range(vocab_size))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return default_chat_prompt(messages)

    def decode(self, ids: list[int]) -> str:
        eos = self.eos_token_id
        return bytes(i & 0xFF for i in ids if i != eos).decode("utf-8", errors="replace")

    def token_bytes(self) -> tuple[bytes, ...]:
        return self._token_bytes

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
        # At load, not on the first request's engine step (GPT-2's 50,257 ids take tens of ms).
        self._token_bytes = byte_level_token_bytes(tokenizer)

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

    def token_bytes(self) -> tuple[bytes, ...] | None:
        """Per-id bytes for a byte-level BPE (GPT-2's family); None for any other tokenizer."""
        return self._token_bytes

    def clone(self) -> HFTokenizer:
        # A fast tokenizer's Rust object is not safe to use from two threads at once ("Already
        # borrowed"); a deep copy has its own. The bytes table is immutable: shared.
        twin = copy.copy(self)
        twin._tokenizer = copy.deepcopy(self._tokenizer)
        return twin


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → character map: printable Latin-1 bytes stand for themselves, the rest
    (control bytes, space, ...) for the characters from U+0100 on, in byte order. Written out
    because transformers 5 no longer exports it from its GPT-2 tokenizer module."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def byte_level_token_bytes(tokenizer: Any) -> tuple[bytes, ...] | None:
    """Each id's bytes under a fast tokenizer whose decoder is exactly `ByteLevel`, else None.

    What `decode(ids, skip_special_tokens=True)` does there (tokenizers' Rust `Tokenizer::decode`
    and `ByteLevel::decode_chain`): it drops ids it has no token for and tokens whose content is a
    special added token's, maps each remaining token to bytes (its characters through GPT-2's
    byte map when all of them are in it, else the token's own UTF-8, which is how an added token
    like " foo" or "日本" comes out as itself) and decodes the concatenation once, lossily. So a
    table of per-id bytes reproduces `decode` exactly; ids it has no token for get b"". As a
    check that this really is a byte-level BPE, every token of the model's own vocabulary (added
    tokens aside) must be spelt in the byte map.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)  # None: a slow (pure Python) tokenizer
    if backend is None:
        return None
    from tokenizers import decoders

    if type(backend.decoder) is not decoders.ByteLevel:  # not a Sequence, Replace, ... around it
        return None
    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    added = backend.get_added_tokens_decoder()
    special = {token.content for token in added.values() if token.special}
    table: list[bytes] = []
    for i in range(len(tokenizer)):
        token = backend.id_to_token(i)
        if token is None or token in special:
            table.append(b"")
            continue
        try:
            table.append(bytes([byte_of[c] for c in token]))
        except KeyError:
            if i not in added:
                return None
            table.append(token.encode("utf-8"))
    return tuple(table)


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text pieces that never split a character.

    With a byte-level tokenizer (`Tokenizer.token_bytes`), each id's bytes are decoded as UTF-8
    as they come: O(1) per token, and the pieces add up to exactly `decode(ids)` (an incomplete
    character's bytes, at most 3, are held until the byte that completes it, or until one shows
    they never will and they become U+FFFD, as a one-shot lossy decode has them). An id
    past the table decodes to nothing, as transformers' fast `decode` drops an id it has no token
    for; a model whose vocabulary is padded past its tokenizer's can sample one.

    Any other tokenizer: text-generation-inference's `decode_token` window. Decode the window
    (the previously emitted piece's ids for context, then the unread ones) with and without the
    unread ones, and emit the difference once it no longer ends in U+FFFD (an incomplete
    character). So that a window that never closes (a run of stray byte tokens, or of ids that
    add no text) cannot make every token slower, at most `MAX_PENDING` ids are held back: the
    one inexactness is that the text held then is committed as it decodes at that moment (an
    unfinished character as U+FFFD; ids that added no text leave the context).
    """

    MAX_PENDING = 8  # a character is at most 4 bytes: twice that is room for ids that add nothing

    __slots__ = ("_table", "_held", "_tokenizer", "_ids", "_read")

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._table = tokenizer.token_bytes()
        self._held = b""  # the start of an incomplete character
        self._ids: list[int] = []  # the fallback's window: context ids, then unread ones
        self._read = 0  # the fallback's first unread id in `_ids`

    def push(self, token_id: int) -> str:
        """The text that token_id completes ("" while a character is unfinished)."""
        table = self._table
        if table is None:
            return self._push_window(token_id)
        if not 0 <= token_id < len(table):
            return ""
        # codecs' incremental UTF-8 decoder, inlined: its Python-level `decode` costs a third more.
        data = self._held + table[token_id] if self._held else table[token_id]
        text, used = utf_8_decode(data, "replace", False)
        if used == len(data):
            self._held = b""
            return text
        held = data[used:]
        if held[0] == 0xED and len(held) == 2 and held[1] >= 0xA0:
            # A surrogate's first two bytes, which `decode` already has as two U+FFFD whatever
            # follows; CPython's incremental decoder waits for a third byte to say so.
            self._held = b""
            return text + "\ufffd\ufffd"
        self._held = held
        return text

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end decodes as U+FFFD)."""
        if self._table is not None:
            text = utf_8_decode(self._held, "replace", True)[0]
            self._held = b""
            return text
        ids, decode = self._ids, self._tokenizer.decode
        text = decode(ids)[len(decode(ids[: self._read])) :]
        del ids[: self._read]
        self._read = len(ids)
        return text

    def _push_window(self, token_id: int) -> str:
        ids, decode = self._ids, self._tokenizer.decode
        ids.append(token_id)
        prefix_text = decode(ids[: self._read])
        text = decode(ids)
        pending = len(ids) - self._read
        if len(text) > len(prefix_text) and (not text.endswith("\ufffd") or pending >= self.MAX_PENDING):
            del ids[: self._read]  # the unread ids become the next piece's context
            self._read = len(ids)
            return text[len(prefix_text) :]
        if pending >= self.MAX_PENDING:  # this many ids and no text at all: forget them
            del ids[self._read :]
        return ""
