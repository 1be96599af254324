"""How fast a replica computes, as its served calls time it: the figure its record announces and trainers
route by (samples per second of forward and backward together)."""

from __future__ import annotations

import time
from typing import Callable, Dict

__all__ = ["ThroughputMeter"]


class ThroughputMeter:
    """EMA of seconds of compute per sample, per kind of work; throughput = samples/s of fwd+bwd.

    The first ``warmup_calls`` calls of each kind are not counted: they pay for lazy initialisation
    (allocator, kernels) and would make a fresh replica look several times slower than it is. A kind
    not measured for ``stale_s`` seconds no longer counts, and its next measurement starts afresh: a
    replica that gets no work (standing by, or set aside by trainers) then reads 0, unknown, rather
    than a figure from conditions long gone, and times itself anew (:meth:`StageRunner.measure_speed`)."""

    def __init__(
        self,
        alpha: float = 0.2,
        warmup_calls: int = 1,
        stale_s: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.alpha, self.warmup_calls, self.stale_s, self.clock = alpha, warmup_calls, stale_s, clock
        self.served = 0  # served calls counted so far (a replica's own speed test is not one)
        self.cost_s: Dict[str, float] = {}
        self.updated_at: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}

    def update(self, kind: str, samples: int, elapsed_s: float) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        if self.calls[kind] <= self.warmup_calls:
            return
        self.served += 1
        now, cost = self.clock(), elapsed_s / max(samples, 1)
        old = self.cost_s.get(kind) if self._fresh(kind, now) else None
        self.cost_s[kind] = cost if old is None else (1 - self.alpha) * old + self.alpha * cost
        self.updated_at[kind] = now

    def set(self, kind: str, samples: int, elapsed_s: float) -> None:
        """Replace the figure of ``kind`` with one measurement (a replica timing itself, not a served call);
        served calls after it count from the first."""
        self.cost_s[kind] = elapsed_s / max(samples, 1)
        self.updated_at[kind] = self.clock()
        self.calls[kind] = max(self.calls.get(kind, 0), self.warmup_calls)

    def _fresh(self, kind: str, now: float) -> bool:
        return kind in self.cost_s and now - self.updated_at[kind] <= self.stale_s

    @property
    def samples_per_s(self) -> float:
        now = self.clock()
        cost = {kind: value for kind, value in self.cost_s.items() if self._fresh(kind, now)}
        if "forward_backward" in cost:
            total = cost["forward_backward"]
        elif "backward" in cost:
            total = cost["backward"] + cost.get("forward", 0.0)
        else:
            return 0.0
        return 1.0 / total if total > 0 else 0.0
