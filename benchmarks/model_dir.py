"""A local GPT-2 small directory with a real-sized BPE tokenizer, for benchmarks that need one.

    python -m benchmarks.model_dir [--out benchmarks/out/gpt2-small-bpe]

GPT-2's weights and tokenizer cannot be downloaded here, and the embedded `random-gpt2` uses a
byte tokenizer whose cost is nil. This saves what the issue's measurements used: GPT-2 small with
transformers' seeded random weights and a byte-level BPE trained to GPT-2's 50,257 entries on the
Python standard library's sources (any local text would do), written by `save_pretrained` so the
worker loads it through `from_pretrained` like a real checkpoint. Training takes about a minute;
an existing directory is reused.
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from benchmarks.common import out_dir

VOCAB_SIZE = 50257
EOS = "<|endoftext|>"


def corpus(limit_bytes: int = 64 << 20) -> Iterator[str]:
    """Text from the standard library's sources, up to `limit_bytes`."""
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        total += len(text)
        yield text
        if total >= limit_bytes:
            return


def save(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    from worker.loading import RANDOM_SEED

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus(), trainer)
    tokenizer = GPT2TokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = GPT2Config(vocab_size=VOCAB_SIZE, bos_token_id=eos_id, eos_token_id=eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_SEED)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def ensure(path: Path | None = None) -> Path:
    """The directory at `path` (default benchmarks/out/gpt2-small-bpe), made if it is missing."""
    path = path or out_dir() / "gpt2-small-bpe"
    if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
        print(f"saving a random GPT-2 small with a {VOCAB_SIZE:,}-entry BPE to {path} ...", file=sys.stderr)
        save(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    print(ensure(parser.parse_args().out))


if __name__ == "__main__":
    main()
