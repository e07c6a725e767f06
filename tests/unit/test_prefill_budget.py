"""The prompt budget beside decoding streams, learned from the steps' timing."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.prefill_budget import FLOOR, INITIAL, STRETCH, PrefillBudget


def step_ms(decode_rows: int, prompt_tokens: int) -> float:
    """A step's cost: fixed, per decode row, per prompt token (the shape of a CPU step)."""
    return 5.0 + 0.4 * decode_rows + 0.05 * prompt_tokens


def test_until_both_costs_are_measured_the_budget_is_the_initial_one() -> None:
    budget = PrefillBudget(cap=2048)
    assert budget.while_decoding == INITIAL
    budget.observe(0.02, 32, 64)  # mixed, before any decode-only step: cannot be split
    budget.observe(0.01, 32, 0)
    assert budget.while_decoding == INITIAL and budget.token_s is None
    assert PrefillBudget(cap=40).while_decoding == 40


def test_the_budget_keeps_a_step_within_the_stretch_of_a_decode_only_one() -> None:
    budget = PrefillBudget(cap=2048)
    for _ in range(50):
        budget.observe(step_ms(32, 0) / 1000, 32, 0)
        budget.observe(step_ms(32, 64) / 1000, 32, 64)
    tokens = budget.while_decoding
    assert tokens == int((STRETCH - 1) * step_ms(32, 0) / 0.05)  # 0.8 * 17.8 ms / 0.05 ms = 284
    assert step_ms(32, tokens) <= STRETCH * step_ms(32, 0) + 1e-9
    # A bigger batch's decode step is longer: the prompt may take more of it.
    for _ in range(50):
        budget.observe(step_ms(128, 0) / 1000, 128, 0)
        budget.observe(step_ms(128, 64) / 1000, 128, 64)
    assert budget.while_decoding > tokens


def test_prefill_only_steps_teach_the_cost_of_a_prompt_token() -> None:
    budget = PrefillBudget(cap=2048)
    budget.observe(step_ms(0, 2000) / 1000, 0, 2000)
    budget.observe(step_ms(8, 0) / 1000, 8, 0)
    assert budget.token_s is not None and abs(budget.token_s - 0.0525e-3) < 1e-6
    assert budget.while_decoding == int(0.8 * step_ms(8, 0) / 0.0525)


def test_a_cheap_decode_step_still_leaves_the_floor_to_waiting_prompts() -> None:
    budget = PrefillBudget(cap=2048)
    budget.observe(0.0055, 1, 0)  # one stream decoding: 5.5 ms a step
    budget.observe(0.0055 + 0.0006 * 64, 1, 64)  # 0.6 ms a prompt token: the stretch allows 7
    assert budget.while_decoding == FLOOR


@given(
    st.integers(1, 4096),
    st.lists(st.tuples(st.floats(-1.0, 5.0, allow_nan=False), st.integers(0, 256), st.integers(0, 4096)), max_size=60),
)
def test_the_budget_stays_between_the_floor_and_the_cap(cap: int, steps: list[tuple[float, int, int]]) -> None:
    budget = PrefillBudget(cap=cap)
    for seconds, rows, tokens in steps:
        budget.observe(seconds, rows, tokens)
        assert min(FLOOR, cap) <= budget.while_decoding <= cap
