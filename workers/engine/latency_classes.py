"""Latency classes: the time a step may take, from the priorities it holds.

Per priority, a target in seconds (`targets`) and a slowdown bound (`slowdowns`: how many
times the cost of the step with only that priority's work and any more urgent work in it).
Once a step holds a priority with either, less urgent work joins it only while the cost
model predicts the step stays within the tightest of them (the scheduler's cap).

A target in seconds binds only where a full step is slower than it: a tiny model's
256-wide step took ~15 ms against a 40 ms `high` target, so a high job ran every step at
that width, 17-21x its time alone (bench/priority_latency.py). A slowdown bound follows the
device and the model instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.step_cost import StepCostModel
from workers.engine.step_draft import StepDraft


@dataclass(slots=True)
class LatencyClasses:
    """Priority value -> target seconds, and priority value -> slowdown bound (>= 1); a
    priority missing from both has no latency class."""

    targets: dict[int, float] = field(default_factory=dict)
    slowdowns: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for priority, seconds in self.targets.items():
            if not seconds > 0:
                raise ValueError(f"step time target of priority {priority} must be > 0")
        for priority, factor in self.slowdowns.items():
            if not factor >= 1:
                raise ValueError(f"step slowdown of priority {priority} must be >= 1, got "
                                 f"{factor}")

    def level_scheduled(self, step: StepDraft, level: int, cost_model: StepCostModel) -> None:
        """Note that `step` now holds `level`'s work (and all more urgent work)."""
        step.levels_scheduled.add(level)
        factor = self.slowdowns.get(level)
        if factor is not None and cost_model.is_fitted:
            step.slowdown_caps.append(factor * cost_model.predict(step.shape))

    def cap(self, step: StepDraft, cost_model: StepCostModel) -> float | None:
        """Seconds the step may take, from the levels it already holds (None: no cap)."""
        if not cost_model.is_fitted:
            return None
        caps = [self.targets[p] for p in step.levels_scheduled if p in self.targets]
        caps += step.slowdown_caps
        return min(caps) if caps else None
