"""The prompt budget beside decoding streams, learned from the steps' timing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.prefill_budget import FLOOR, STRETCH, PrefillBudget


def step_ms(decode_rows: int, prompt_tokens: int) -> float:
    """A step's cost: fixed, per decode row, per prompt token (the shape of a CPU step)."""
    return 5.0 + 0.4 * decode_rows + 0.05 * prompt_tokens


def learned(budget: PrefillBudget, rows: int, times: int = 50) -> None:
    for _ in range(times):
        budget.observe(step_ms(rows, 0) / 1000, rows, 0)
        budget.observe(step_ms(rows, 64) / 1000, rows, 64)


def test_until_both_costs_are_measured_a_step_takes_the_whole_cap() -> None:
    budget = PrefillBudget(cap=2048)
    assert budget.while_decoding(32) == 2048
    budget.observe(0.02, 32, 64)  # mixed, before any decode-only step: cannot be split
    budget.observe(0.01, 32, 0)
    assert budget.while_decoding(32) == 2048 and budget.token_s is None
    assert PrefillBudget(cap=40).while_decoding(32) == 40


def test_the_budget_keeps_a_step_within_the_stretch_of_a_decode_only_one_of_its_batch() -> None:
    budget = PrefillBudget(cap=2048)
    learned(budget, 32)
    tokens = budget.while_decoding(32)
    assert tokens == int((STRETCH - 1) * step_ms(32, 0) / 0.05)  # 0.8 * 17.8 ms / 0.05 ms = 284
    assert step_ms(32, tokens) <= STRETCH * step_ms(32, 0) + 1e-9
    learned(budget, 128)  # a bigger batch's decode step is longer: the prompt may take more of it
    assert budget.while_decoding(128) > tokens
    # The batch shrinks while prompts keep coming (no decode-only step of its size yet): costed at
    # the nearest batch measured, not at the last one, and the prompt's cost is not inflated.
    for _ in range(50):
        budget.observe(step_ms(32, 200) / 1000, 32, 200)
    assert budget.while_decoding(32) == tokens
    assert budget.token_s is not None and abs(budget.token_s - 0.05e-3) < 1e-9


def test_prompt_only_steps_are_costed_less_a_steps_fixed_part() -> None:
    budget = PrefillBudget(cap=2048)
    budget.observe(step_ms(0, 2000) / 1000, 0, 2000)  # no decode-only step measured yet: no sample
    assert budget.token_s is None
    budget.observe(step_ms(1, 0) / 1000, 1, 0)
    budget.observe(step_ms(0, 2000) / 1000, 0, 2000)
    assert budget.token_s is not None and abs(budget.token_s - (step_ms(0, 2000) - step_ms(1, 0)) / 2000e3) < 1e-12


def test_a_cheap_decode_step_still_leaves_the_floor_to_waiting_prompts() -> None:
    budget = PrefillBudget(cap=2048)
    budget.observe(0.0055, 1, 0)  # one stream decoding: 5.5 ms a step
    budget.observe(0.0055 + 0.0006 * 64, 1, 64)  # 0.6 ms a prompt token: the stretch allows 7
    assert budget.while_decoding(1) == FLOOR


@given(
    st.integers(1, 4096),
    st.lists(st.tuples(st.floats(-1.0, 5.0, allow_nan=False), st.integers(0, 256), st.integers(0, 4096)), max_size=60),
    st.integers(1, 512),
)
def test_the_budget_stays_between_the_floor_and_the_cap(
    cap: int, steps: list[tuple[float, int, int]], rows: int
) -> None:
    budget = PrefillBudget(cap=cap)
    for seconds, decode_rows, tokens in steps:
        budget.observe(seconds, decode_rows, tokens)
        assert min(FLOOR, cap) <= budget.while_decoding(rows) <= cap
