"""How much one trainer's micro-batch may move a stage's gradient: decisions over plain numbers, no I/O.

A trainer chooses what it sends: the ``grad_outputs`` of every stage below the last, and the
targets of the last. A replica therefore bounds each micro-batch's contribution to its
accumulated gradient, and down-weights a trainer whose targets do not follow from its inputs.
The stage runner (:mod:`swarm.server.runner`) measures, asks :class:`ContributionGuard`, and applies.

**Per-micro-batch clip.** A micro-batch of ``b`` samples adds ``b * g`` to the accumulator, ``g``
being its batch-mean gradient. ``g`` is clipped to the L2 norm ``tau`` (the *per-sample bound*)
before it is added, so the micro-batch adds at most ``b * tau``: proportional to its samples, as an
honest contribution is. ``tau = clip_multiplier x reference``; the reference is the lower median
over trainers of each trainer's median recent norm (:func:`clip_reference`), recomputed for every
micro-batch. A trainer that inflates its norms moves only its own median: the lower median of two
trainers is the smaller one, of three with one liar an honest one; an honest trainer that joins
late caps a liar from its first micro-batch on. A fresh replica holds its first micro-batches
back until they come from two trainers (:func:`warmup_done`) and then clips them with the bound
they establish together, so the first trainer it hears from cannot set the bound alone. No
replica can tell a forged magnitude from an honest one while a single trainer feeds it; an
explicit ``max_grad_norm`` is the only bound then. Small micro-batches have noisier means and are
trimmed more often than large ones; the bound is meant for trainers that use one micro-batch size.

**A trainer's share.** Let ``S_T`` be the samples trainer ``T`` contributed to one replica's step
and ``S`` all the samples of that step at that replica; ``T``'s *share* is ``S_T / S``. The replica's
mean gradient is ``sum_i(b_i * clip(g_i)) / S``, so ``T``'s part of it has a norm of at most
``S_T * tau / S = share x tau`` (:func:`share_bound`), whatever ``T`` sends, ``tau`` being the largest
bound applied in the step (:attr:`ContributionGuard.largest_bound`). A down-weighted
micro-batch still counts its samples. More weight costs a trainer more samples sent through
every stage, and each sample's influence stays bounded by ``tau``.

**Targets unrelated to the inputs.** The last stage sees the loss of each micro-batch and the
model's own predictive distribution ``p``. For a model trained by maximum likelihood on mostly
honest data, the mean cross-entropy of honest targets is close to the mean entropy of ``p`` (the
model is calibrated on average). Targets drawn without regard to the context cost more than the
model expects. The *excess loss* ``loss - entropy(p)`` (nats) is that signal
(:func:`loss_outliers`): a trainer is down-weighted while its mean excess over its recent
micro-batches is above ``excess_margin`` *and* more than ``excess_gap`` above the lower median of
all trainers' mean excesses. The last stage weighs the micro-batch's loss, so the grad_inputs it
returns, and with them the gradients of every stage below, carry the weight. The absolute condition
protects a trainer whenever the model is calibrated on its data, so it works with two trainers, one of
them lying (the model is then calibrated on the mixture, and the two excesses move apart in opposite
directions). The relative
condition keeps a model that is miscalibrated for everyone from down-weighting everyone. The
signal appears only once the model uses the context (before, shuffled targets teach the same
byte frequencies as honest ones and do little harm). An honest trainer whose data the model has
not learnt (a minority distribution) can look like an outlier: the margins and the window make it
rare, not impossible. A trainer that picks targets the model finds likely is not detected, and
one that relays forged grad_outputs to lower stages meets only their clip.

**Whom it holds against.** Every statistic gives each trainer identity one vote, so the bounds are
sound for an honest majority of trainer identities (an allowlist keeps identities from being
forged). With two trainers, one of them lying, the lower median sides with the smaller value: a
trainer cannot raise the bound, but it can lower it by sending tiny gradients, which slows
training (honest micro-batches are clipped towards its norms) without poisoning it. Zero norms
(micro-batches the last stage down-weighted to nothing) are not counted.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Collection, Deque, Dict, FrozenSet, Iterable, Mapping, Optional, Sequence, Set, Tuple

__all__ = [
    "PoisoningConfig",
    "trainer_of",
    "median",
    "lower_median",
    "clip_reference",
    "clip_bound",
    "clip_factor",
    "share_bound",
    "warmup_done",
    "loss_outliers",
    "ContributionGuard",
]


@dataclass
class PoisoningConfig:
    """How a replica bounds what one trainer's micro-batches contribute."""

    clip_multiplier: float = 4.0  # a micro-batch's mean gradient is clipped to this many times the reference norm
    # a fixed per-sample bound (L2 norm of a micro-batch's mean gradient) instead of the adaptive one; None = adaptive
    max_grad_norm: Optional[float] = None
    history_size: int = 32  # recent micro-batch gradient norms kept per trainer
    # micro-batches a fresh replica holds back, at least, before its first bound (twice as many if they all come
    # from one trainer)
    warmup_micro_batches: int = 8
    trainer_memory_steps: int = 8  # a trainer not seen for this many steps is forgotten
    excess_window: int = 32  # recent excess losses (nats) kept per trainer on the last stage
    min_excess_count: int = 16  # micro-batches of a trainer before its excess loss is judged
    # nats of mean excess loss (loss - model entropy) above which a trainer can be an outlier
    excess_margin: float = 0.1
    excess_gap: float = 0.25  # nats by which an outlier's mean excess loss exceeds the lower median over trainers
    outlier_weight: float = 0.0  # weight of an outlier trainer's micro-batches (0 = ignored, 1 = no down-weighting)

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip_multiplier) and self.clip_multiplier >= 1.0):
            raise ValueError(f"clip_multiplier must be a finite number >= 1, got {self.clip_multiplier!r}")
        if self.max_grad_norm is not None and not (math.isfinite(self.max_grad_norm) and self.max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be positive or None, got {self.max_grad_norm!r}")
        for name in (
            "history_size",
            "warmup_micro_batches",
            "trainer_memory_steps",
            "excess_window",
            "min_excess_count",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.min_excess_count > self.excess_window:
            raise ValueError(
                f"min_excess_count ({self.min_excess_count}) cannot exceed excess_window ({self.excess_window})"
            )
        for name in ("excess_margin", "excess_gap"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"{name} must be a non-negative number of nats, got {getattr(self, name)!r}")
        if not 0.0 <= self.outlier_weight <= 1.0:
            raise ValueError(f"outlier_weight must be in [0, 1], got {self.outlier_weight!r}")


def trainer_of(micro_batch_id: str) -> str:
    """The trainer a micro-batch belongs to: stage servers accept only ids that start with the caller's peer id."""
    return micro_batch_id.partition(":")[0]


def median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    if not ordered:
        raise ValueError("median of no values")
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def lower_median(values: Iterable[float]) -> float:
    """The median, or the smaller of the two middle values: with two trainers, the smaller one."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("lower_median of no values")
    return ordered[(len(ordered) - 1) // 2]


def clip_reference(norms_by_trainer: Mapping[str, Sequence[float]]) -> Optional[float]:
    """The typical micro-batch gradient norm: the lower median over trainers of each one's median norm.

    None when no norm was seen yet. Each trainer counts once however many micro-batches it sends."""
    medians = [median(norms) for norms in norms_by_trainer.values() if norms]
    return lower_median(medians) if medians else None


def clip_bound(norms_by_trainer: Mapping[str, Sequence[float]], config: PoisoningConfig) -> Optional[float]:
    """The per-sample bound ``tau`` for the next micro-batches, or None while nothing bounds them."""
    if config.max_grad_norm is not None:
        return config.max_grad_norm
    reference = clip_reference(norms_by_trainer)
    return None if reference is None else config.clip_multiplier * reference


def clip_factor(norm: float, bound: Optional[float]) -> float:
    """What a micro-batch's mean gradient of L2 norm ``norm`` is multiplied by so that it is at most ``bound``."""
    if bound is None or not norm > bound:
        return 1.0
    return bound / norm


def share_bound(samples_by_trainer: Mapping[str, int], trainer: str, bound: float) -> float:
    """The largest norm ``trainer``'s micro-batches can add to a replica's mean gradient of one step:
    its share of the step's samples times the per-sample bound."""
    total = sum(samples_by_trainer.values())
    return 0.0 if total == 0 else samples_by_trainer.get(trainer, 0) / total * bound


def warmup_done(held_back: int, norms_by_trainer: Mapping[str, Sequence[float]], config: PoisoningConfig) -> bool:
    """Whether a replica that holds back ``held_back`` micro-batches has seen enough to bound them: at
    least ``warmup_micro_batches`` from two trainers, or twice as many (a bound on the memory they take)."""
    trainers = sum(1 for norms in norms_by_trainer.values() if norms)
    return held_back >= 2 * config.warmup_micro_batches or (held_back >= config.warmup_micro_batches and trainers >= 2)


def loss_outliers(
    excess_by_trainer: Mapping[str, Sequence[float]], config: PoisoningConfig, current: Collection[str] = ()
) -> FrozenSet[str]:
    """The trainers to down-weight on the last stage: those judged (at least ``min_excess_count`` excess
    losses) whose mean excess loss is above ``excess_margin`` and more than ``excess_gap`` above the
    lower median of all judged trainers' mean excesses. A trainer in ``current`` (down-weighted now)
    stays down-weighted until its mean falls below half of either margin, so that noise near the
    margins does not flip its weight back and forth."""
    means = {
        trainer: sum(values) / len(values)
        for trainer, values in excess_by_trainer.items()
        if len(values) >= config.min_excess_count
    }
    if not means:
        return frozenset()
    reference = lower_median(means.values())

    def outlier(trainer: str, mean: float) -> bool:
        slack = 0.5 if trainer in current else 1.0
        return mean > slack * config.excess_margin and mean - reference > slack * config.excess_gap

    return frozenset(trainer for trainer, mean in means.items() if outlier(trainer, mean))


class ContributionGuard:
    """A replica's memory of what trainers sent it, and the bounds and weights that follow from it.

    Bookkeeping over floats (no tensors, no I/O); the stage runner calls it under its lock."""

    def __init__(self, config: PoisoningConfig):
        self.config = config
        self.norms: Dict[str, Deque[float]] = {}  # trainer -> recent mean-gradient norms of its micro-batches
        self.excess: Dict[str, Deque[float]] = {}  # trainer -> recent excess losses (nats), last stage only
        self.last_seen: Dict[str, int] = {}  # trainer -> the step it last contributed to
        self.outliers: FrozenSet[str] = frozenset()  # trainers down-weighted now
        self.step = 0
        # bounds apply; False while a fresh replica holds micro-batches back
        self.warm = config.max_grad_norm is not None
        self.largest_bound = 0.0  # the largest per-sample bound applied in the current step
        # trainer -> the largest norm / bound of its micro-batches clipped this step
        self.step_clips: Dict[str, float] = {}
        # trainers that exceeded the bound grossly in the last finished step
        self.offenders: FrozenSet[str] = frozenset()
        self.clipped = 0  # micro-batches clipped so far
        self.down_weighted = 0  # micro-batches weighted below 1 so far

    def record_norm(self, trainer: str, norm: float) -> None:
        if norm > 0.0:
            self.norms.setdefault(trainer, deque(maxlen=self.config.history_size)).append(norm)
        self.last_seen[trainer] = self.step

    @property
    def bound(self) -> Optional[float]:
        """The per-sample bound for the next micro-batch; None while warming up."""
        return clip_bound(self.norms, self.config) if self.warm else None

    def clip_factor(self, trainer: str, norm: float) -> float:
        bound = self.bound
        self.largest_bound = max(self.largest_bound, bound or 0.0)
        factor = clip_factor(norm, bound)
        if factor < 1.0:
            self.clipped += 1
            self.step_clips[trainer] = max(self.step_clips.get(trainer, 1.0), 1.0 / factor)
        return factor

    def record_excess(self, trainer: str, excess: float) -> Tuple[Set[str], Set[str]]:
        """Remember a last-stage micro-batch's excess loss; returns the trainers (newly down-weighted, cleared)."""
        self.excess.setdefault(trainer, deque(maxlen=self.config.excess_window)).append(excess)
        self.last_seen[trainer] = self.step
        before = self.outliers
        self.outliers = loss_outliers(self.excess, self.config, before)
        return set(self.outliers - before), set(before - self.outliers)

    def weight(self, trainer: str) -> float:
        """The weight of the trainer's next micro-batch (below 1 only on the last stage)."""
        return self.config.outlier_weight if trainer in self.outliers else 1.0

    def ready(self, held_back: int) -> bool:
        """Whether bounds apply, or the ``held_back`` micro-batches suffice to end the warm-up
        (see :func:`warmup_done`)."""
        return self.warm or warmup_done(held_back, self.norms, self.config)

    def settle(self) -> None:
        """End the warm-up: from now on every micro-batch meets a bound (once any norm is known)."""
        self.warm = True

    def start_step(self, step: int) -> Tuple[Dict[str, float], Set[str]]:
        """A new step starts: forget trainers gone for ``trainer_memory_steps`` steps (all of them: warm up
        again). Returns the finished step's clips (trainer -> largest norm / bound) and the trainers that
        exceeded the bound by more than ``clip_multiplier`` (far beyond an honest spike) when the step
        before did not."""
        self.step = step
        gone = [t for t, seen in self.last_seen.items() if step - seen > self.config.trainer_memory_steps]
        for trainer in gone:
            for table in (self.norms, self.excess, self.last_seen):
                table.pop(trainer, None)
        self.outliers = loss_outliers(self.excess, self.config, self.outliers)
        self.warm = self.config.max_grad_norm is not None or any(self.norms.values())
        self.largest_bound = 0.0
        clips, self.step_clips = self.step_clips, {}
        before = self.offenders
        self.offenders = frozenset(t for t, ratio in clips.items() if ratio > self.config.clip_multiplier)
        return clips, set(self.offenders - before)
