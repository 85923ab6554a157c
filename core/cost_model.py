"""A worker's latency model, fitted from its own step timings (Mooncake §5; DistServe §4).

One linear model explains every engine step, prefill chunks and decodes alike::

    step_s = base_s + per_token_s * num_new_tokens + per_seq_s * num_seqs + per_attn_s * attn_pairs

``num_new_tokens`` are the tokens the step computed (prompt chunk tokens plus one per decoding
sequence), ``num_seqs`` the sequences in the batch, ``attn_pairs`` the attention work in units of
1000 (query, key) pairs: a chunk of ``n`` new tokens after ``c`` cached ones attends
``n * (c + (n + 1) / 2)`` pairs, a decoding sequence with ``k`` KV tokens ``k`` pairs. Prefill
and decode times follow from the same coefficients, so a worker that mostly decodes still
predicts its prefill, and the router compares prefill workers and decode workers in one unit.

Workers fit it online (:class:`StepTimeFit`, least squares over a sliding window of recent
steps) and publish the coefficients in their heartbeat as part of their
:class:`core.worker_load.WorkerLoad` (``cost_*`` keys); the router parses them once per registry
read to predict TTFT and TBT per candidate.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np

ATTN_PAIRS_UNIT = 1000.0  # attn_pairs are counted in thousands of (query, key) pairs


def prefill_attn_pairs(num_new_tokens: int, num_context_tokens: int) -> float:
    """Attention work (thousands of pairs) of ``num_new_tokens`` after ``num_context_tokens``."""
    return num_new_tokens * (num_context_tokens + (num_new_tokens + 1) / 2) / ATTN_PAIRS_UNIT


@dataclass(frozen=True)
class StepSample:
    """One engine step as measured: what it computed and how long it took (wall seconds).

    ``duration_s`` is the whole pass as the step loop sees it: from the end of the previous
    forward (or the start of the loop when it was idle) to the end of this one, so it holds the
    scheduling, input preparation, output processing and delivery between two forwards, not only
    forward + sampling (``forward_s``, of which it is part; 0 when not measured apart).
    """

    num_new_tokens: int
    num_seqs: int
    attn_pairs: float  # thousands of (query, key) pairs, see prefill_attn_pairs
    duration_s: float
    forward_s: float = 0.0

    @property
    def host_s(self) -> float:
        """Seconds of the pass outside forward + sampling (0 when ``forward_s`` is not known)."""
        return max(0.0, self.duration_s - self.forward_s) if self.forward_s else 0.0


@dataclass(frozen=True)
class CostModel:
    """Fitted step-time coefficients of one worker, in seconds, plus its KV-load bandwidth.

    A zero ``num_samples`` means nothing was measured yet (``WorkerLoad.fitted_cost_model`` is
    then None) and the router falls back to load counts.
    """

    base_s: float = 0.0
    per_token_s: float = 0.0
    per_seq_s: float = 0.0
    per_attn_s: float = 0.0  # per thousand (query, key) pairs
    num_samples: int = 0
    max_num_batched_tokens: int = 2048  # the worker's chunk budget: a prompt takes ceil(n / budget) steps
    kv_load_bytes_per_s: float = 0.0  # measured pool -> worker bandwidth; 0: not measured yet
    kv_bytes_per_token: float = 0.0  # KV bytes of one token across all layers (the KVCacheSpec's)

    def step_s(self, num_new_tokens: int, num_seqs: int, attn_pairs: float) -> float:
        """Predicted duration of one step (seconds)."""
        return max(
            0.0,
            self.base_s + self.per_token_s * num_new_tokens + self.per_seq_s * num_seqs + self.per_attn_s * attn_pairs,
        )

    def prefill_s(self, num_uncached_tokens: int, num_cached_tokens: int = 0) -> float:
        """Seconds to compute ``num_uncached_tokens`` prompt tokens after ``num_cached_tokens``
        whose KV is already present, in chunks of ``max_num_batched_tokens`` (one step each)."""
        if num_uncached_tokens <= 0:
            return 0.0
        total_s, done = 0.0, 0
        budget = max(1, self.max_num_batched_tokens)
        while done < num_uncached_tokens:
            n = min(budget, num_uncached_tokens - done)
            total_s += self.step_s(n, 1, prefill_attn_pairs(n, num_cached_tokens + done))
            done += n
        return total_s

    def kv_load_s(self, num_tokens: int) -> float:
        """Seconds to load ``num_tokens`` tokens' KV from the pool; 0 when not yet measured."""
        if num_tokens <= 0 or self.kv_load_bytes_per_s <= 0:
            return 0.0
        return num_tokens * self.kv_bytes_per_token / self.kv_load_bytes_per_s

    def decode_step_s(self, batch_size: int, num_kv_tokens: int) -> float:
        """Seconds of one decode step for ``batch_size`` sequences holding ``num_kv_tokens`` in all."""
        return self.step_s(batch_size, batch_size, num_kv_tokens / ATTN_PAIRS_UNIT)


class StepTimeFit:
    """Fit of :class:`CostModel` coefficients over the last ``window`` steps, minimising the mean
    absolute relative error (what the router's predictions are judged by).

    Robust: the relative L1 fit is solved by iteratively reweighted least squares
    (``robust_iterations`` rounds), so a few steps slowed down 10x by a noisy neighbour barely
    move it, where plain least squares would follow them. Coefficients are kept non-negative (a
    step never gets faster with more work): a negative one is pinned to zero and the rest
    refitted. Ridge ``regularization`` keeps the fit defined while the samples do not yet vary
    in every feature (e.g. only single-sequence decodes so far).
    """

    def __init__(self, window: int = 512, regularization: float = 1e-6, robust_iterations: int = 10):
        if window < 4:
            raise ValueError(f"window must be >= 4, got {window}")
        if robust_iterations < 0:
            raise ValueError(f"robust_iterations must be >= 0, got {robust_iterations}")
        self._samples: deque[StepSample] = deque(maxlen=window)
        self.regularization = regularization
        self.robust_iterations = robust_iterations

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: StepSample) -> None:
        """Records one step; non-finite or negative durations are ignored."""
        if math.isfinite(sample.duration_s) and sample.duration_s >= 0:
            self._samples.append(sample)

    def clear(self) -> None:
        """Forgets every sample."""
        self._samples.clear()

    def samples(self) -> list[StepSample]:
        """The samples in the window, oldest first (a copy)."""
        return list(self._samples)

    def fit(self) -> tuple[float, float, float, float]:
        """(base_s, per_token_s, per_seq_s, per_attn_s); zeros with no samples.

        Rows are divided by ``duration_s`` (relative error, so short decode steps count as much
        as long prefill chunks), then reweighted by ``1 / |relative residual|`` each round (IRLS
        for the L1 norm, residuals floored at 1%).
        """
        if not self._samples:
            return (0.0, 0.0, 0.0, 0.0)
        x = np.array([[1.0, s.num_new_tokens, s.num_seqs, s.attn_pairs] for s in self._samples])
        y = np.array([s.duration_s for s in self._samples])
        relative = 1.0 / np.maximum(y, max(float(y.max()), 1e-9) * 1e-3)
        x, y = x * relative[:, None], y * relative  # now y is ~1 and residuals are relative
        coef = self._solve(x, y, np.ones(len(y)))
        for _ in range(self.robust_iterations):
            residual = np.abs(y - x @ coef)
            coef = self._solve(x, y, 1.0 / np.maximum(residual, 0.01))
        return tuple(float(c) for c in coef)  # type: ignore[return-value]

    def _solve(self, x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
        """Non-negative ridge solution of min sum(weights * (y - x @ coef)^2). Each column is
        scaled to unit RMS first, so ``regularization`` weighs every coefficient alike whatever
        its feature's magnitude (tokens run to thousands, the intercept is 1)."""
        root = np.sqrt(weights)
        xw, yw = x * root[:, None], y * root
        scale = np.sqrt((xw * xw).mean(axis=0))
        scale[scale == 0] = 1.0
        xw = xw / scale
        active = [0, 1, 2, 3]
        coef = np.zeros(4)
        while active:
            xa = xw[:, active]
            gram = xa.T @ xa + self.regularization * len(yw) * np.eye(len(active))
            solution = np.linalg.solve(gram, xa.T @ yw)
            if (solution >= 0).all():
                coef[active] = solution
                break
            active.pop(int(np.argmin(solution)))
        return coef / scale

    def model(self, **fields) -> CostModel:
        """A CostModel of the current fit; ``fields`` set the non-fitted ones (bandwidth, budget)."""
        base_s, per_token_s, per_seq_s, per_attn_s = self.fit()
        return CostModel(base_s, per_token_s, per_seq_s, per_attn_s, num_samples=len(self._samples), **fields)


class BandwidthMeter:
    """EWMA of a transfer's bandwidth (bytes / second), e.g. pool -> worker KV loads.

    Only real transfers count: one of less than ``min_bytes`` (e.g. an empty prefix) or of no
    measurable duration is ignored. ``alpha`` is the weight of the newest transfer.
    """

    def __init__(self, alpha: float = 0.2, min_bytes: int = 1):
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.min_bytes = min_bytes
        self.bytes_per_s = 0.0  # 0: nothing measured yet
        self.num_transfers = 0

    def record(self, num_bytes: int, duration_s: float) -> None:
        """Folds one transfer of ``num_bytes`` that took ``duration_s`` seconds into the average."""
        if num_bytes < max(1, self.min_bytes) or not math.isfinite(duration_s) or duration_s <= 0:
            return
        rate = num_bytes / duration_s
        self.bytes_per_s = rate if self.num_transfers == 0 else self.alpha * rate + (1 - self.alpha) * self.bytes_per_s
        self.num_transfers += 1
