"""The time-to-first-token model of one endpoint: what the deadline check predicts with.

A request routed to an endpoint waits for its first token behind the requests there that have
not produced theirs, and for its own prefill. So the model is linear in what the governor sees
when it routes the request:

    ttft ≈ w0 + w1 * (its prompt tokens) + w2 * (prompt tokens waiting there before it)
              + w3 * (requests waiting there)

w1 is what its own prefill takes per token (a long prompt is prefilled in chunks, one a step,
among the running streams), w2 what the prompts ahead of it add per token (a scheduler may
interleave them with it), w3 what each waiting request adds beyond its tokens (a batch slot, a
scheduling step), w0 the fixed path (two socket hops, one decode step). Its own prompt and the
ones ahead are two features because they cost differently under chunked prefill: one
coefficient for both, fitted mostly on short prompts, under-predicted every long one. The
weights are fitted by least squares over the requests' observed first tokens, with exponential
forgetting so that the model follows an endpoint whose speed changes (another workload on the
machine), and a small ridge so that it stays defined with few or collinear samples. A
prediction is an upper estimate: the fit plus `margin` standard deviations of its recent
residuals (Mooncake refuses on predicted TTFT the same way; the margin trades early refusals
for deadlines met). No prediction before `MIN_SAMPLES` first tokens: the deadline check admits
until then.

The margin is learnt, not set: residuals are not normal (a long prefill ahead, a batch that grew
after admission), so a fixed 1.65 sigma covers some share of first tokens nobody chose. Each sample
is an exceedance when it came later than the prediction the model makes for it (fit plus margin,
before the sample is learnt); an expired request's wait is one too (its first token was later
still). The margin then takes a stochastic-approximation step toward the multiple of sigma that
`EXCEEDANCE` of first tokens exceed: up `STEP` x (1 - EXCEEDANCE) after an exceedance, down
`STEP` x EXCEEDANCE otherwise (Robbins-Monro for a quantile), so exceedances settle at that share
whatever the residuals' shape. `--deadline-margin` is where it starts.
"""

from __future__ import annotations

import math

MIN_SAMPLES = 8
FORGETTING = 0.98  # each sample's weight decays by this per newer sample: ~50 samples of memory
RIDGE = 1e-6
TOKEN_SCALE = 1000.0  # features are scaled to order 1 so the ridge treats them alike
REQUEST_SCALE = 10.0
EXCEEDANCE = 0.05
"""The share of first tokens the margin is learnt to leave later than predicted."""
STEP = 0.1
"""The margin's learning step, in standard deviations: an exceedance raises it 0.095 sigma, a
sample within it lowers it 0.005 sigma (so a shift shows within a few hundred samples)."""
MAX_MARGIN = 5.0
MARGIN_AFTER = 32
"""Samples before the margin learns: the first ones miss the fit's error (a fit of a few samples,
under a load that is still building), not the margin's, and a margin raised by them would take
hundreds of samples to come down."""


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a small square system; None when singular."""
    n = len(b)
    m = [[*row, rhs] for row, rhs in zip(a, b, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-12:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


Features = tuple[float, float, float, float]
FEATURES = 4


class TtftModel:
    __slots__ = ("margin", "samples", "exceeded", "_xtx", "_xty", "_weights", "_residual_var", "_residuals")

    def __init__(self, margin: float = 1.65) -> None:
        self.margin = margin  # standard deviations of the residuals added to the fit: learnt from here
        self.samples = 0
        self.exceeded = 0  # samples later than their prediction (`observe`)
        self._xtx = [[0.0] * FEATURES for _ in range(FEATURES)]
        self._xty = [0.0] * FEATURES
        self._weights: list[float] | None = None
        self._residual_var = 0.0
        self._residuals = 0

    @staticmethod
    def _features(prompt_tokens: int, tokens_ahead: int, requests_ahead: int) -> Features:
        return 1.0, prompt_tokens / TOKEN_SCALE, tokens_ahead / TOKEN_SCALE, requests_ahead / REQUEST_SCALE

    @staticmethod
    def _value(w: list[float], x: Features) -> float:
        return max(0.0, w[0] * x[0] + w[1] * x[1] + w[2] * x[2] + w[3] * x[3])

    def fit(self, prompt_tokens: int, tokens_ahead: int, requests_ahead: int) -> float | None:
        """The least-squares TTFT (seconds) of a prompt of `prompt_tokens` behind `tokens_ahead`
        prompt tokens of `requests_ahead` requests; None until the model has samples."""
        w = self._weights
        if w is None or self.samples < MIN_SAMPLES:
            return None
        return self._value(w, self._features(prompt_tokens, tokens_ahead, requests_ahead))

    def predict(self, prompt_tokens: int, tokens_ahead: int, requests_ahead: int) -> float | None:
        """The fit plus the margin: what the deadline is compared with."""
        fit = self.fit(prompt_tokens, tokens_ahead, requests_ahead)
        return None if fit is None else fit + self.margin * math.sqrt(self._residual_var)

    def observe(self, prompt_tokens: int, tokens_ahead: int, requests_ahead: int, ttft_s: float) -> None:
        """A request of `prompt_tokens` routed under this load got its first token after `ttft_s`."""
        x = self._features(prompt_tokens, tokens_ahead, requests_ahead)
        w = self._weights
        if w is not None and self.samples >= MIN_SAMPLES:  # the error of a prediction
            error = ttft_s - self._value(w, x)
            if self.samples >= MARGIN_AFTER and self._residual_var > 0:  # a settled prediction: learn the margin
                over = error > self.margin * math.sqrt(self._residual_var)
                self.exceeded += over
                step = STEP * ((1.0 - EXCEEDANCE) if over else -EXCEEDANCE)
                self.margin = min(MAX_MARGIN, max(0.0, self.margin + step))
            self._residuals += 1
            # a plain mean over the first samples, then the same forgetting as the fit
            rate = max(1.0 - FORGETTING, 1.0 / self._residuals)
            self._residual_var += rate * (error * error - self._residual_var)
        xtx, xty = self._xtx, self._xty
        for i in range(FEATURES):
            xty[i] = FORGETTING * xty[i] + x[i] * ttft_s
            row = xtx[i]
            for j in range(FEATURES):
                row[j] = FORGETTING * row[j] + x[i] * x[j]
        self.samples += 1
        regularised = [[xtx[i][j] + (RIDGE if i == j else 0.0) for j in range(FEATURES)] for i in range(FEATURES)]
        weights = _solve(regularised, xty)
        if weights is not None:
            self._weights = weights
