"""The only code that touches the device: builds a step's tensors, runs the model, samples."""

from __future__ import annotations

import torch

from worker.kv_cache import KVCache
from worker.model import GPT2, PackedBatch, Segment
from worker.sampling import make_generator, sample
from worker.scheduler import Chunk
from worker.sequence import Sequence


class ModelRunner:
    def __init__(self, model: GPT2, kv_cache_tokens: int) -> None:
        param = next(model.parameters())
        self.model = model
        self.device = param.device
        self.dtype = param.dtype
        self.cache = KVCache(model.shape, kv_cache_tokens, param.dtype, param.device)
        self._generators: dict[Sequence, torch.Generator] = {}

    def run(self, chunks: list[Chunk]) -> list[int]:
        """Run one step; return the sampled token of each chunk that `samples`, in chunk order."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        segments: list[Segment] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        for chunk in chunks:
            seq = chunk.seq
            q_start = len(ids)
            if chunk.is_prefill:
                ids += seq.prompt_ids[chunk.start : chunk.end]
            else:
                ids.append(seq.token_at(chunk.start))  # a decode step feeds the last sampled token
            positions += range(chunk.start, chunk.end)
            slots += range(seq.kv_start + chunk.start, seq.kv_start + chunk.end)
            segments.append(Segment(q_start, len(ids), seq.kv_start, chunk.end))
            if chunk.samples:
                sample_rows.append(len(ids) - 1)
                sampled.append(seq)
        device = self.device
        batch = PackedBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            slots=torch.tensor(slots, dtype=torch.long, device=device),
            segments=segments,
            sample_rows=torch.tensor(sample_rows, dtype=torch.long, device=device),
        )
        logits = self.model(batch, self.cache)
        if not sampled:
            return []
        return sample(logits, [s.sampling for s in sampled], [self._generator(s) for s in sampled])

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        if seq.sampling.is_greedy:
            return None
        generator = self._generators.get(seq)
        if generator is None:
            generator = self._generators[seq] = make_generator(seq.sampling, self.device)
        return generator

    def release(self, seq: Sequence) -> None:
        self._generators.pop(seq, None)
