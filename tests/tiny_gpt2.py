"""A tiny GPT-2 checkpoint made by the tests themselves: random weights, a trained byte-level BPE.

Saved with `save_pretrained` so the engine loads it through transformers' real loading code
(`GPT2LMHeadModel.from_pretrained`, `AutoTokenizer.from_pretrained`), as it would a real GPT-2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

EOS = "<|endoftext|>"
N_POSITIONS = 128
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Governors keep inference workers healthy under bursts of traffic.",
    "Continuous batching lets requests join and leave at every step.",
    "naïve café, Straße, 日本語のテキスト, emoji 🙂 and ünïcödé",
] * 20


def save_tiny_gpt2(path: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator(CORPUS, trainer)
    tokenizer = GPT2TokenizerFast(tokenizer_object=bpe, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    # A large initializer spreads the logits, so greedy choices are not near-ties that float
    # rounding of a different (but equally valid) summation order could flip.
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=N_POSITIONS,
        n_embd=64,
        n_layer=2,
        n_head=4,
        initializer_range=0.2,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234)
        model = GPT2LMHeadModel(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_greedy(hf: tuple[Any, Any], prompt: str, max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of one prompt alone, cut before end-of-sequence."""
    import torch

    model, tokenizer = hf
    ids = torch.tensor([tokenizer.encode(prompt)])
    eos = tokenizer.eos_token_id
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=eos
        )
    tokens: list[int] = out[0, ids.shape[1] :].tolist()
    return tokens[: tokens.index(eos)] if eos in tokens else tokens
