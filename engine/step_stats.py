"""StepStats: one engine's measured step times, the cost model fitted from them, recent load.

Fed one :class:`core.cost_model.StepSample` per forward pass by the engine thread; read by the
same thread when it refreshes its stats snapshot (so no lock: the snapshot handed to other
threads is an immutable :class:`core.cost_model.CostModel`).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from core.cost_model import CostModel, StepSample, StepTimeFit


class StepStats:
    """Sliding-window cost-model fit plus the last step and a short mean of step times.

    The fit is redone lazily in :meth:`model`, at most once per ``refit_every`` new samples (and
    on every new sample while fewer than ``refit_every`` were seen, so an early model is fresh).
    """

    def __init__(self, window: int = 512, recent: int = 16, refit_every: int = 16):
        if refit_every < 1 or recent < 1:
            raise ValueError(f"refit_every and recent must be >= 1, got {refit_every}, {recent}")
        self.fit = StepTimeFit(window)
        self.refit_every = refit_every
        self._recent_s: deque[float] = deque(maxlen=recent)
        self.last: StepSample | None = None
        self.num_steps = 0  # every sample ever recorded
        self._num_at_fit = -1
        self._model = CostModel()

    def record(self, sample: StepSample) -> None:
        """Adds one pass's measurement. Mutates the fit window and the recent-step queue."""
        self.fit.add(sample)
        self._recent_s.append(sample.duration_s)
        self.last = sample
        self.num_steps += 1

    @property
    def recent_step_time_s(self) -> float:
        """Mean duration of the last ``recent`` passes (seconds); 0 before any."""
        return sum(self._recent_s) / len(self._recent_s) if self._recent_s else 0.0

    def model(self, **fields) -> CostModel:
        """The current fit as a CostModel; ``fields`` fill the non-fitted ones (see CostModel)."""
        new = self.num_steps - self._num_at_fit
        if new > 0 and (new >= self.refit_every or len(self.fit) < self.refit_every):
            self._model = self.fit.model()
            self._num_at_fit = self.num_steps
        return dataclasses.replace(self._model, **fields)

    def forget_last(self) -> None:
        """Drops the last-step and recent-mean gauges (the fit keeps its samples): after a
        calibration, so the idle worker reports no load."""
        self.last = None
        self._recent_s.clear()
