"""The bounded series behind the dashboard's charts: loss, swarm throughput and global steps over time.

No I/O: the poller adds one point per DHT snapshot, the state builder reads them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional

__all__ = ["HistoryPoint", "StepMark", "History"]


@dataclass(frozen=True)
class HistoryPoint:
    """One snapshot's swarm-wide figures."""

    t: float  # seconds since the dashboard started
    loss: Optional[float]  # mean of the trainers' announced losses; None when no trainer announces one
    samples_per_s: float  # summed over trainers
    tokens_per_s: float  # summed over trainers
    global_step: Optional[int]  # None while no replica is online


@dataclass(frozen=True)
class StepMark:
    """When the dashboard first saw the swarm at a global step."""

    step: int
    t: float  # seconds since the dashboard started


class History:
    """The last ``max_points`` snapshots' figures, and the last ``max_points`` global steps with the time
    each was first seen. Memory stays bounded however long the run lasts."""

    def __init__(self, max_points: int):
        if max_points < 2:
            raise ValueError(f"a history needs at least 2 points to draw a line, got max_points={max_points}")
        self.points: Deque[HistoryPoint] = deque(maxlen=max_points)
        self.steps: Deque[StepMark] = deque(maxlen=max_points)

    def add(self, point: HistoryPoint) -> None:
        if self.points and point.t < self.points[-1].t:
            raise ValueError(f"history points must come in time order: {point.t} after {self.points[-1].t}")
        self.points.append(point)
        step = point.global_step
        if step is not None and (not self.steps or step > self.steps[-1].step):
            self.steps.append(StepMark(step, point.t))  # a step that goes back (a restarted swarm) is not news

    def series(self) -> dict:
        """The points as parallel lists, the shape the page's charts take."""
        points: List[HistoryPoint] = list(self.points)
        return {
            "t": [round(p.t, 3) for p in points],
            "loss": [p.loss for p in points],
            "samples_per_s": [round(p.samples_per_s, 3) for p in points],
            "tokens_per_s": [round(p.tokens_per_s, 3) for p in points],
            "global_step": [p.global_step for p in points],
        }

    def step_marks(self) -> List[dict]:
        return [{"step": m.step, "t": round(m.t, 3)} for m in self.steps]
