"""The C sampler's binding (worker/kernels/draw.py): what it accepts and what degenerate rows give.
Its draws are checked against float64 inverse-CDF sampling in test_sampling.py, through `sample`."""

from __future__ import annotations

import pytest
import torch

from worker.kernels.draw import DrawKernel, cpu_draw


@pytest.fixture(scope="module")
def kernel() -> DrawKernel:
    built = cpu_draw()
    assert built is not None, "the test machine has a C compiler"
    return built


def params(m: int, top_k: int = 0, top_p: float = 1.0, u: float = 0.5) -> tuple[torch.Tensor, ...]:
    return (
        torch.ones(m),
        torch.full((m,), top_k, dtype=torch.int64),
        torch.full((m,), top_p, dtype=torch.float64),
        torch.full((m,), u, dtype=torch.float64),
    )


def test_rows_with_nothing_to_draw_from_give_a_valid_token(kernel: DrawKernel) -> None:
    nan, inf = float("nan"), float("inf")
    logits = torch.tensor(
        [
            [0.0, inf, 1.0, inf],  # an infinite logit: the first, as greedy
            [nan, nan, nan, nan],
            [-inf, -inf, -inf, -inf],
            [nan, 2.0, nan, 1.0],  # NaN weighs nothing: the others are drawn from
        ]
    )
    for top_k, top_p in ((0, 1.0), (2, 1.0), (0, 0.5)):
        for u in (0.0, 0.999):
            tokens = kernel(logits, *params(4, top_k, top_p, u)).tolist()
            assert tokens[0] == 1 and tokens[2] == 0 and 0 <= tokens[1] < 4 and tokens[3] in (1, 3)


def test_the_kernel_refuses_what_it_cannot_read(kernel: DrawKernel) -> None:
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="float32 CPU logits"):
        kernel(x.double(), *params(2))
    with pytest.raises(ValueError, match="float32 CPU logits"):
        kernel(torch.randn(8, 2).t(), *params(2))
    inv_t, top_k, top_p, uniform = params(2)
    with pytest.raises(ValueError, match="contiguous torch.float64"):
        kernel(x, inv_t, top_k, top_p.float(), uniform)
    with pytest.raises(ValueError, match="contiguous torch.int64"):
        kernel(x, inv_t, top_k[:1], top_p, uniform)
    with pytest.raises(ValueError, match="rows of 0"):
        kernel(torch.empty(2, 0), *params(2))
    assert kernel(torch.empty(0, 5), *params(0)).shape == (0,)


@pytest.mark.parametrize("vocab", [3000, 5000])
@pytest.mark.parametrize("spread", [1.0, 3.0, 8.0])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (0, 0.9), (5, 1.0), (2000, 0.9)])
def test_draws_from_either_path_hold_their_uniform(
    kernel: DrawKernel, vocab: int, spread: float, top_k: int, top_p: float
) -> None:
    """Uniforms spread over [0, 1), the last ones close to 1, so that draws fall past a row's
    likely tokens (the listed path's edges) as well as among them, on peaked rows and on flat ones
    (more likely tokens than it lists: the bucketed path)."""
    from tests.unit.worker.test_sampling import reference_interval

    m, temperature = 64, 0.7
    logits = torch.randn(m, vocab, generator=torch.Generator().manual_seed(vocab + int(spread))) * spread
    uniform = torch.cat([torch.linspace(0, 0.98, m - 8), 1 - torch.logspace(-2, -7, 8)]).double()
    inv_t = torch.full((m,), 1 / temperature)
    tokens = kernel(logits, inv_t, *params(m, top_k, top_p)[1:3], uniform).tolist()
    slack = 1e-5 + vocab * 2**-24
    for i, token in enumerate(tokens):
        lo, hi = reference_interval(logits[i], temperature, top_k, top_p, token)
        assert lo - slack <= float(uniform[i]) <= hi + slack, (i, token, lo, float(uniform[i]), hi)
