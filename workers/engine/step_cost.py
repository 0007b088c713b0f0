"""How long a step takes, learned online from the engine's own steps.

Responsibilities:
- record each step's wall time against what it did: tokens computed, KV positions read
  by attention, sequences in the batch;
- fit `seconds = a + b * tokens + c * kv_tokens + d * num_seqs` by least squares, with
  old steps forgotten geometrically so the fit follows the machine (other load, thermal
  limits, a warmed-up allocator) and never needs tuning per CPU or GPU;
- keep every coefficient >= 0 (a feature the data cannot tell apart from the others is
  dropped rather than given a negative weight that would make a wider step look cheaper);
- answer `predict` for a step being assembled, and say when too few steps were seen to
  trust it (`is_fitted`).

The same model serves the scheduler's latency classes and the service rate a worker
reports for its ETAs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

NUM_FEATURES = 4  # 1, tokens, kv_tokens, num_seqs


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step does, in the units the cost model prices."""

    num_tokens: int  # tokens the model computes (prefill chunks + decodes)
    num_kv_tokens: int  # KV positions attention reads, summed over sequences
    num_seqs: int

    def plus(self, num_tokens: int, num_kv_tokens: int, num_seqs: int = 1) -> StepShape:
        """This step with one more sequence's work added."""
        return StepShape(
            self.num_tokens + num_tokens,
            self.num_kv_tokens + num_kv_tokens,
            self.num_seqs + num_seqs,
        )


EMPTY_STEP = StepShape(0, 0, 0)


class StepCostModel:
    """Least-squares step time over (1, tokens, kv_tokens, num_seqs), fitted online."""

    def __init__(self, *, forgetting: float = 0.995, min_steps: int = 8) -> None:
        if not 0 < forgetting <= 1:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.forgetting = forgetting
        self.min_steps = min_steps
        self.num_steps = 0
        # Normal equations X^T X (row-major) and X^T y, decayed by `forgetting` per step.
        # Features are scaled (tokens / 1e3, kv / 1e5, seqs / 1e2) so their columns are of
        # one order. Plain floats: observe() runs every step, where a few numpy calls cost
        # more than the 20 products they would vectorise.
        self._xtx = [0.0] * (NUM_FEATURES * NUM_FEATURES)
        self._xty = [0.0] * NUM_FEATURES
        self._coef: np.ndarray | None = None

    @staticmethod
    def _features(shape: StepShape) -> tuple[float, float, float, float]:
        return (1.0, shape.num_tokens / 1e3, shape.num_kv_tokens / 1e5, shape.num_seqs / 1e2)

    @property
    def is_fitted(self) -> bool:
        """True once enough steps were seen for predictions to mean something."""
        return self.num_steps >= self.min_steps

    def observe(self, shape: StepShape, seconds: float) -> None:
        """Record one step's shape and measured wall time."""
        if seconds < 0 or shape.num_seqs < 1:
            return
        x = self._features(shape)
        f, xtx, xty = self.forgetting, self._xtx, self._xty
        for i, xi in enumerate(x):
            xty[i] = xty[i] * f + xi * seconds
            row = i * NUM_FEATURES
            for j, xj in enumerate(x):
                xtx[row + j] = xtx[row + j] * f + xi * xj
        self.num_steps += 1
        self._coef = None

    def coefficients(self) -> tuple[float, float, float, float]:
        """(seconds per step, per token, per KV token, per sequence), all >= 0."""
        coef = self._fit()
        return (
            float(coef[0]),
            float(coef[1]) / 1e3,
            float(coef[2]) / 1e5,
            float(coef[3]) / 1e2,
        )

    def predict(self, shape: StepShape) -> float:
        """Seconds a step of this shape is expected to take (0.0 before any step)."""
        if shape.num_seqs == 0:
            return 0.0
        coef = self._fit()
        return sum(xi * float(c) for xi, c in zip(self._features(shape), coef, strict=True))

    def max_new_tokens_within(
        self, shape: StepShape, num_context_tokens: int, seconds: float
    ) -> int:
        """Most tokens one more sequence (with this much KV before them) may add to `shape`
        and keep the step within `seconds`; 0 when not even one fits."""
        base = self.predict(shape.plus(0, num_context_tokens))
        _, per_token, per_kv, _ = self.coefficients()
        per_new_token = per_token + per_kv  # each new token is computed and also read
        room = seconds - base
        if room < 0:
            return 0
        if per_new_token <= 0:
            return 1 << 30
        return int(room / per_new_token)

    def _fit(self) -> np.ndarray:
        if self._coef is not None:
            return self._coef
        # A small ridge keeps the solve defined while features have not varied yet (a run of
        # decode-only steps has tokens == num_seqs); active features that come out negative
        # are dropped and the rest refitted (a few rounds of a non-negative least squares).
        xtx = np.array(self._xtx).reshape(NUM_FEATURES, NUM_FEATURES)
        xty = np.array(self._xty)
        ridge = 1e-6 * max(1.0, float(np.trace(xtx)))
        active = list(range(NUM_FEATURES))
        coef = np.zeros(NUM_FEATURES)
        while active:
            a = xtx[np.ix_(active, active)] + ridge * np.eye(len(active))
            solved = np.linalg.solve(a, xty[active])
            negative = [f for f, c in zip(active, solved, strict=True) if c < 0]
            if not negative:
                coef[:] = 0.0
                coef[active] = solved
                break
            active = [f for f in active if f not in negative]
        self._coef = coef
        return coef
