"""Decode attention (the C kernel and the gather path) and prompt-chunk attention against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker.attention import GatherDecode, KernelDecode, Segment, prefill_attention
from worker.kernels.decode_attention import DecodeAttentionKernel, cpu_decode_attention

H, D, BLOCK = 4, 16, 8
T = 40 * BLOCK  # an arena of 40 blocks
SCALE = D**-0.5


@pytest.fixture(scope="module")
def kernel() -> DecodeAttentionKernel:
    built = cpu_decode_attention()
    assert built is not None, "the test machine has a C compiler"
    return built


def arena(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    keys, values = torch.randn(2, H, T, D, generator=g).to(dtype)
    # q as the engine has it: a strided view of the fused qkv projection, rows 3 * H * D apart
    q = torch.randn(6, 3, H, D, generator=g).to(dtype)[:, 0]
    return q, keys, values


# row -> (block table, context length): scattered blocks, a partial last block, consecutive ones
CONTEXTS = {
    0: ([5], 1),
    2: ([3, 10, 1, 20, 7], 37),
    3: (list(range(30, 38)), 64),
    5: ([39, 0, 12, 2, 25, 9, 14, 33, 4, 6, 21, 11, 16, 8, 19, 22, 28], 129),
}


def context_rows(table: list[int], n: int) -> list[int]:
    return [table[t // BLOCK] * BLOCK + t % BLOCK for t in range(n)]


def expected(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> dict[int, torch.Tensor]:
    out = {}
    for row, (table, n) in CONTEXTS.items():
        index = torch.tensor(context_rows(table, n))
        k, v = keys[:, index].double(), values[:, index].double()
        out[row] = F.scaled_dot_product_attention(q[row, :, None].double(), k, v, scale=SCALE)[:, 0]
    return out


def run(
    decode_cls: str, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, kernel: DecodeAttentionKernel
) -> torch.Tensor:
    rows = torch.tensor(list(CONTEXTS))
    lens = torch.tensor([n for _, n in CONTEXTS.values()])
    width = max(len(table) for table, _ in CONTEXTS.values()) + 1  # one column more than needed
    tables = torch.tensor([table + [0] * (width - len(table)) for table, _ in CONTEXTS.values()])
    out = torch.full((q.shape[0], H, D), 7.0, dtype=q.dtype)
    if decode_cls == "kernel":
        KernelDecode(kernel, rows, tables, lens, BLOCK, SCALE)(q, keys, values, out)
    else:
        GatherDecode(rows, tables, lens, int(lens.max()) + 5, BLOCK, SCALE)(q, keys, values, out)
    return out


@pytest.mark.parametrize("decode_cls", ["kernel", "gather"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_each_row_attends_to_its_own_blocks_only(
    decode_cls: str, dtype: torch.dtype, tolerance: float, kernel: DecodeAttentionKernel
) -> None:
    q, keys, values = arena(dtype)
    out = run(decode_cls, q, keys, values, kernel)
    for row, want in expected(q, keys, values).items():
        assert torch.allclose(out[row].double(), want, atol=tolerance, rtol=tolerance), row
    untouched = [r for r in range(q.shape[0]) if r not in CONTEXTS]
    assert torch.all(out[untouched] == 7.0)  # rows that are not decode rows are left alone


def test_the_kernel_refuses_tensors_it_cannot_read(kernel: DecodeAttentionKernel) -> None:
    q, keys, values = arena()
    rows, tables, lens = torch.tensor([0]), torch.tensor([[0]]), torch.tensor([3])
    out = torch.empty(6, H, D)
    with pytest.raises(ValueError, match="no kernel"):
        kernel(q.double(), keys.double(), values.double(), rows, tables, lens, BLOCK, out.double(), SCALE)
    with pytest.raises(ValueError, match="contiguous heads"):
        kernel(torch.randn(6, D, H).transpose(1, 2), keys, values, rows, tables, lens, BLOCK, out, SCALE)
    with pytest.raises(ValueError, match="arena strides"):
        kernel(q, keys.transpose(0, 1).contiguous().transpose(0, 1), values, rows, tables, lens, BLOCK, out, SCALE)
    with pytest.raises(ValueError, match="int64 of one length"):
        kernel(q, keys, values, rows, tables, torch.tensor([3, 4]), BLOCK, out, SCALE)
    with pytest.raises(ValueError, match="tables must be int64"):
        kernel(q, keys, values, rows, torch.tensor([0]), lens, BLOCK, out, SCALE)


@pytest.mark.parametrize("consecutive", [True, False])
def test_a_later_prompt_chunk_attends_causally_to_everything_before_it(consecutive: bool) -> None:
    q, keys, values = arena()
    out = torch.zeros(6, H, D)
    # rows 1..4 are the last 4 tokens of a 20-token context in 3 blocks
    table = [6, 7, 8] if consecutive else [9, 2, 30]
    index = torch.tensor(context_rows(table, 20))
    if consecutive:
        segment, gather = Segment(1, 5, 6 * BLOCK, 20), None
    else:
        segment, gather = Segment(1, 5, -1, 20, gather_at=3), torch.cat([torch.tensor([0, 0, 0]), index])
    prefill_attention(q, keys, values, [segment], gather, out, SCALE)
    for i, row in enumerate(range(1, 5)):
        n = 16 + i + 1  # query i sits at position 16 + i and sees positions 0 .. 16 + i
        k, v = keys[:, index[:n]], values[:, index[:n]]
        want = F.scaled_dot_product_attention(q[row, :, None], k, v, scale=SCALE)[:, 0]
        assert torch.allclose(out[row], want, atol=1e-5)
