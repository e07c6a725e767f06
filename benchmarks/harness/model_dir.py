"""Local GPT-2 directories for benchmarks that need more than the embedded random models.

    python -m benchmarks.harness.model_dir [--trained] [--out DIR]

GPT-2's weights and tokenizer cannot be downloaded here. Two stand-ins, written by
`save_pretrained` so the worker loads them through `from_pretrained` like a real checkpoint, made
once and reused:
- `gpt2-small-bpe`: GPT-2 small with transformers' seeded random weights and a byte-level BPE
  trained to GPT-2's 50,257 entries on the Python standard library's sources (any local text
  would do): GPT-2 small's real cost, a tokenizer that costs what a real one does (about a minute).
- `gpt2-trained-small` (`--trained`): a 4-layer, 256-wide GPT-2 with an 8,192-entry BPE, trained
  on the same sources for `--train-seconds` on this CPU. Random weights give near-flat logits, on
  which any rounding flips the argmax; a trained model's distributions are peaked as a real one's
  are, which is what a dtype's accuracy check needs (benchmarks/engine/dtypes.py).
"""

from __future__ import annotations

import argparse
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness.common import out_dir

VOCAB_SIZE = 50257
TRAINED_VOCAB_SIZE = 8192
TRAINED_CONTEXT = 128
EOS = "<|endoftext|>"


TRAINING_BYTES = 8 << 20
"""What the trained model learns from: the corpus's first files, up to 8 MiB."""


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


def held_out(limit_bytes: int = 64 << 10) -> Iterator[str]:
    """Corpus text the trained model never learnt from: the files after its `TRAINING_BYTES`, up to
    `limit_bytes` more (its perplexity's text, benchmarks/harness/perplexity.py)."""
    seen = 0
    for text in corpus(TRAINING_BYTES + limit_bytes):
        if seen >= TRAINING_BYTES:
            yield text
        seen += len(text)


def bpe_tokenizer(vocab_size: int) -> Any:
    """A GPT-2 style byte-level BPE of `vocab_size` entries trained on `corpus()`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(corpus(), trainer)
    return GPT2TokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS)


def save(path: Path) -> Path:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from worker.loading import RANDOM_SEED

    tokenizer = bpe_tokenizer(VOCAB_SIZE)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    config = GPT2Config(vocab_size=VOCAB_SIZE, bos_token_id=eos_id, eos_token_id=eos_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_SEED)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train(path: Path, seconds: float, seed: int = 0) -> Path:
    """Train a small GPT-2 on the corpus for about `seconds`; save it with its tokenizer."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = bpe_tokenizer(TRAINED_VOCAB_SIZE)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids = torch.tensor([i for text in corpus(TRAINING_BYTES) for i in [*tokenizer.encode(text), eos_id]])
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=TRAINED_CONTEXT, n_embd=256, n_layer=4, n_head=4,
        bos_token_id=eos_id, eos_token_id=eos_id,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    started, step = time.monotonic(), 0
    while time.monotonic() - started < seconds:
        starts = torch.randint(0, len(ids) - TRAINED_CONTEXT - 1, (16,), generator=generator)
        batch = torch.stack([ids[s : s + TRAINED_CONTEXT] for s in starts.tolist()])
        loss = model(batch, labels=batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 50 == 0:
            print(f"  step {step}: loss {loss.item():.3f} ({time.monotonic() - started:.0f} s)", file=sys.stderr)
    model.eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    (path / "training.txt").write_text(f"{step} steps of 16 x {TRAINED_CONTEXT} tokens; last loss {loss.item():.3f}\n")
    return path


def ensure(path: Path | None = None) -> Path:
    """The random GPT-2 small with a BPE at `path` (default benchmarks/out/gpt2-small-bpe)."""
    path = path or out_dir() / "gpt2-small-bpe"
    if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
        print(f"saving a random GPT-2 small with a {VOCAB_SIZE:,}-entry BPE to {path} ...", file=sys.stderr)
        save(path)
    return path


def ensure_trained(path: Path | None = None, seconds: float = 600) -> Path:
    """The trained small GPT-2 at `path` (default benchmarks/out/gpt2-trained-small)."""
    path = path or out_dir() / "gpt2-trained-small"
    if not (path / "training.txt").exists():
        print(f"training a small GPT-2 for {seconds:.0f} s into {path} ...", file=sys.stderr)
        train(path, seconds)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--trained", action="store_true", help="the trained small model instead")
    parser.add_argument("--train-seconds", type=float, default=600)
    args = parser.parse_args()
    print(ensure_trained(args.out, args.train_seconds) if args.trained else ensure(args.out))


if __name__ == "__main__":
    main()
