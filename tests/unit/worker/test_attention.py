"""Decode attention (the C kernel and the gather path) and prompt-chunk attention against SDPA."""

from __future__ import annotations

import functools
import platform

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from worker.attention import GatherDecode, KernelDecode, Segment, causal_masks, prefill_attention
from worker.kernels.build import build
from worker.kernels.decode_attention import SOURCE, DecodeAttentionKernel, cpu_decode_attention

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
    """Each row's last context token is this step's: its key and value come with the call, which
    the kernel writes into the arena itself and the gather path expects written (as the model does)."""
    rows = torch.tensor(list(CONTEXTS))
    lens = torch.tensor([n for _, n in CONTEXTS.values()])
    width = max(len(table) for table, _ in CONTEXTS.values()) + 1  # one column more than needed
    tables = torch.tensor([table + [0] * (width - len(table)) for table, _ in CONTEXTS.values()])
    g = torch.Generator().manual_seed(1)
    new_k, new_v = torch.randn(2, q.shape[0], 3, H, D, generator=g).to(q.dtype)[:, :, 1]  # strided, as q
    slots = torch.zeros(q.shape[0], dtype=torch.int64)
    for row, (table, n) in CONTEXTS.items():
        slots[row] = context_rows(table, n)[-1]
    before = keys.clone(), values.clone()
    out = torch.full((q.shape[0], H, D), 7.0, dtype=q.dtype)
    if decode_cls == "kernel":
        KernelDecode(kernel.prepare(rows, tables, lens, BLOCK, SCALE, slots))(q, new_k, new_v, keys, values, out)
    else:
        keys.index_copy_(1, slots[rows], new_k[rows].transpose(0, 1))
        values.index_copy_(1, slots[rows], new_v[rows].transpose(0, 1))
        GatherDecode(rows, tables, lens, int(lens.max()) + 5, BLOCK, SCALE)(q, new_k, new_v, keys, values, out)
    written = slots[rows]
    assert torch.equal(keys[:, written], new_k[rows].transpose(0, 1))
    assert torch.equal(values[:, written], new_v[rows].transpose(0, 1))
    others = torch.ones(T, dtype=torch.bool)
    others[written] = False
    assert torch.equal(keys[:, others], before[0][:, others]) and torch.equal(values[:, others], before[1][:, others])
    return out


@pytest.mark.parametrize("decode_cls", ["kernel", "gather"])
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 3e-3)])
def test_each_row_attends_to_its_own_blocks_only(
    decode_cls: str, dtype: torch.dtype, tolerance: float, kernel: DecodeAttentionKernel
) -> None:
    q, keys, values = arena(dtype)
    out = run(decode_cls, q, keys, values, kernel)
    for row, want in expected(q, keys, values).items():  # over the arena as the call left it
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
    with pytest.raises(ValueError, match="slot for every packed row"):
        kernel.prepare(rows, tables, lens, BLOCK, SCALE)(q, keys, values, out, q, q)
    with pytest.raises(ValueError, match="slot for every packed row"):
        kernel.prepare(rows, tables, lens, BLOCK, SCALE, torch.tensor([0, 1]))(q, keys, values, out, q, q)
    with pytest.raises(ValueError, match="without new values"):
        kernel.prepare(rows, tables, lens, BLOCK, SCALE, torch.zeros(6, dtype=torch.int64))(q, keys, values, out, q)


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
    prefill_attention(q, keys, values, [segment], causal_masks([segment], q.device), gather, out, SCALE)
    for i, row in enumerate(range(1, 5)):
        n = 16 + i + 1  # query i sits at position 16 + i and sees positions 0 .. 16 + i
        k, v = keys[:, index[:n]], values[:, index[:n]]
        want = F.scaled_dot_product_attention(q[row, :, None], k, v, scale=SCALE)[:, 0]
        assert torch.allclose(out[row], want, atol=1e-5)


# The code each kind of CPU gets, built here by taking features away from -march=native: on this
# machine each variant that its CPU can run is tested, whatever the worker itself would pick.
VARIANTS = {
    "native": (),
    "avx512": ("-mno-avx512bf16",),
    "avx2": ("-mno-avx512f",),
    "portable": ("-mno-avx2",),
}
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}  # the output's own rounding


@functools.cache
def variant(name: str) -> DecodeAttentionKernel:
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the variants are x86-64 feature sets")
    return DecodeAttentionKernel(build(SOURCE, VARIANTS[name]))


def test_the_variants_are_the_vector_code_they_are_named_for() -> None:
    isas = {name: variant(name).isa for name in VARIANTS}
    assert isas["portable"] == "portable"
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        assert isas["avx2"] == "avx2"
    if torch.backends.cpu.get_cpu_capability() == "AVX512":
        assert isas["avx512"] == "avx512"
    assert cpu_decode_attention() is not None
    assert cpu_decode_attention().isa == isas["native"]  # type: ignore[union-attr]


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(list(VARIANTS)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    dim=st.sampled_from([1, 2, 7, 16, 24, 33, 64, 80, 128, 256]),
    block=st.sampled_from([1, 3, 16, 32]),
    lens=st.lists(st.integers(0, 70), min_size=1, max_size=4),
    spread=st.sampled_from([0.1, 1.0, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_every_variant_matches_float64_attention(
    name: str, dtype: torch.dtype, dim: int, block: int, lens: list[int], spread: float, seed: int
) -> None:
    """Any head dim up to 256 (vector tails included), block size, context length (0 attends to
    nothing and writes zeros) and score spread (30: a few keys take nearly all the weight, which
    exercises the running maximum's rescaling), on every vector code and storage type."""
    kernel = variant(name)
    if dtype not in kernel.dtypes:
        pytest.skip(f"the compiler has no {dtype}")
    g = torch.Generator().manual_seed(seed)
    heads, width = 2, max(1, -(-max(lens) // block))
    blocks = torch.randperm(len(lens) * width + 3, generator=g)  # scattered, never shared
    tables = blocks[: len(lens) * width].view(len(lens), width).contiguous()
    keys, values = torch.randn(2, heads, (len(lens) * width + 3) * block, dim, generator=g)
    keys, values = (keys * spread / dim**0.5).to(dtype), values.to(dtype)
    q = torch.randn(len(lens) + 1, 3, heads, dim, generator=g).to(dtype)[:, 0]  # strided, as the engine's
    rows = torch.randperm(len(lens) + 1, generator=g)[: len(lens)]
    out = torch.full((len(lens) + 1, heads, dim), 7.0, dtype=dtype)
    kernel(q, keys, values, rows, tables, torch.tensor(lens), block, out, dim**-0.5)
    for i, n in enumerate(lens):
        got = out[rows[i]].double()
        if n == 0:
            assert torch.all(got == 0)
            continue
        index = torch.tensor([int(tables[i, t // block]) * block + t % block for t in range(n)])
        k, v = keys[:, index].double(), values[:, index].double()
        want = F.scaled_dot_product_attention(q[rows[i], :, None].double(), k, v, scale=dim**-0.5)[:, 0]
        assert torch.allclose(got, want, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]), (i, (got - want).abs().max())
    untouched = [r for r in range(len(lens) + 1) if r not in rows.tolist()]
    assert torch.all(out[untouched] == 7.0)


def test_edges_a_step_never_makes_still_answer_soundly(kernel: DecodeAttentionKernel) -> None:
    """A context of 0 tokens over a table of no blocks (nothing to read ahead), and a first group
    of keys that all score -inf (no -inf - -inf: the group weighs nothing)."""
    q, keys, values = arena()
    out = torch.full((6, H, D), 7.0)
    kernel(
        q,
        keys,
        values,
        torch.tensor([0, 1]),
        torch.empty(2, 0, dtype=torch.int64),
        torch.tensor([0, 0]),
        BLOCK,
        out,
        SCALE,
    )
    assert torch.all(out[:2] == 0) and torch.all(out[2:] == 7.0)
    keys = keys.clone()
    keys[:, : 2 * BLOCK, 0] = float("-inf")  # the first 16 tokens of the context below
    q = q.abs()  # so that each of them scores -inf
    tables, n = torch.tensor([[0, 1, 2, 3]]), 4 * BLOCK
    kernel(q, keys, values, torch.tensor([0]), tables, torch.tensor([n]), BLOCK, out, SCALE)
    index = torch.tensor(context_rows([0, 1, 2, 3], n))
    want = F.scaled_dot_product_attention(
        q[0, :, None].double(), keys[:, index].double(), values[:, index].double(), scale=SCALE
    )
    assert torch.allclose(out[0].double(), want[:, 0], atol=1e-5)


def test_new_values_of_another_shape_are_refused(kernel: DecodeAttentionKernel) -> None:
    q, keys, values = arena()
    step = kernel.prepare(
        torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]), BLOCK, SCALE, torch.zeros(6, dtype=torch.int64)
    )
    k = torch.randn(6, H, D)
    with pytest.raises(ValueError, match="new keys"):
        step(q, keys, values, torch.empty(6, H, D), k, k[:1])
