"""Verified replies: when a trainer re-checks a replica's reply, what counts as a lie, and whom to believe.

A stage replica can return wrong but finite activations, input gradients or losses that no shape
or range check catches. The defence (run by each trainer, see :mod:`swarm.client.verification`):

1. **Spot checks.** With probability ``verify_fraction`` per micro-batch and stage (``suspect_fraction``
   for a replica under suspicion), the trainer sends the same request to a second replica (a backward
   marked ``verify``, which computes without accumulating) and compares the two replies.
2. **Same parameters only.** Replies carry the step and digest of the parameters they were computed with;
   replies at different steps, or at one step from replicas whose parameters diverged, are not compared
   (replicas step at slightly different moments, and a diverged replica resyncs from the majority). A
   replica whose replies keep escaping comparison (``max_strikes`` checks in a row, blamed on the
   reply whose step is missing or differs from what its stage announces) is banned by that trainer
   alone: there is no evidence to publish.
3. **Majority of three.** Two replies at the same step that differ by more than ``rtol`` (relative
   L2 distance) send the request to a third replica; the one reply that disagrees with two agreeing
   ones is outvoted: the trainer bans its sender and publishes a signed accusation (stage, step and
   hashes of the inputs and of both replies, the accused and the witnesses). Without a third
   replica, or when the referee agrees with nobody, nothing is decided: both are only suspected.
4. **Accusations are leads, not verdicts.** Another trainer that reads an accusation from a credible
   author suspects the accused for ``suspicion_s``: it spot-checks it at ``suspect_fraction`` and
   bans it only if it sees a mismatch itself (then it confirms the accusation and publishes its
   own). If it checked the accused ``min_checks`` times without a mismatch, the accusation is
   refuted. An author's credit is its confirmed minus its refuted accusations (as this reader saw
   them); at ``-max_refuted`` its accusations are ignored, so every false accusation costs its author.

Limits, by design: a replica that lies to some trainers only makes its honest accusers look wrong to
the others; those then lose nothing but the early warning, since their own checks still catch any
lie told to them. With two replicas of a stage a mismatch cannot be resolved, only suspected.

Tolerance: on CPU a stage's output is bit-identical whether the peer's ForwardBatcher ran a request
alone or merged with others (measured: 32..1024 hidden, 1..200 merged samples, 1 and 2 threads:
zero difference), so honest replicas at the same step agree exactly. ``rtol`` = 1e-4 leaves room for
replicas on other kernels or devices (float32 reductions differ around 1e-6 relative) while any
plausible corruption (noise of half the signal: 0.5; zeros: 1.0; a loss off by 10%: 0.1) is far above it.

Pure: no clocks (``now`` is passed in), no I/O, randomness only through the draws passed in.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

__all__ = [
    "VerificationPolicy",
    "Observation",
    "Verdict",
    "AccusationVerdict",
    "VerificationBook",
    "compared_keys",
    "params_step",
    "replies_agree",
    "compare",
    "outvoted",
    "blame_incomparable",
    "fingerprint",
    "request_fingerprint",
    "COMPARISONS",
]

COMPARISONS = ("agree", "disagree", "incomparable")
MAX_REMEMBERED = 4096  # authors, seen accusations and suspects kept in memory (oldest dropped first)
HASH_BYTES = 8  # blake2b digest size of the evidence hashes: 16 hex characters


@dataclass(frozen=True)
class VerificationPolicy:
    """How often a trainer checks replies, and how it treats what it and others find."""

    verify_fraction: float = 0.02  # probability of checking one stage's reply to one micro-batch
    suspect_fraction: float = 0.5  # that probability for a replica under suspicion
    suspicion_s: float = 60.0  # seconds a suspicion lasts
    min_checks: int = 4  # checks of an accused replica without a mismatch that refute an accusation
    max_refuted: int = 2  # an author whose refuted accusations exceed its confirmed ones by this many is ignored
    max_strikes: int = 4  # checks in a row that a replica's step made impossible before it is banned
    max_step_lag: int = 1  # steps a reply may differ from its stage's announced step without blame
    rtol: float = 1e-4  # relative L2 distance above which two replies at the same step disagree
    ban_s: float = 600.0  # seconds an outvoted replica is banned by the trainer that caught it

    def __post_init__(self) -> None:
        for name in ("verify_fraction", "suspect_fraction"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value!r}")
        for name in ("suspicion_s", "rtol", "ban_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)!r}")
        for name in ("min_checks", "max_refuted", "max_strikes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)!r}")
        if self.max_step_lag < 0:
            raise ValueError(f"max_step_lag must be >= 0, got {self.max_step_lag!r}")


@dataclass(frozen=True)
class Observation:
    """One replica's reply to a request, with the step of the parameters that computed it (None: unknown)."""

    peer_id: str
    step: Optional[int]
    reply: Mapping[str, Any]

    @property
    def digest(self) -> Optional[str]:
        """The digest of the parameters that computed the reply, when the replica sent it."""
        digest = self.reply.get("digest")
        return digest if isinstance(digest, str) else None


def _same_parameters(observations: Sequence[Observation]) -> bool:
    """Replies at one step from replicas whose parameters differ (a stage whose replicas diverged, until they
    resync) cannot be compared: their difference says nothing about who lied."""
    digests = {o.digest for o in observations if o.digest is not None}
    return len({o.step for o in observations}) == 1 and len(digests) <= 1


@dataclass(frozen=True)
class Verdict:
    """The outcome of a check: ``comparison`` is one of :data:`COMPARISONS`."""

    comparison: str
    reason: str = ""


@dataclass(frozen=True)
class AccusationVerdict:
    """What a reader does with an accusation: ``action`` is 'suspect' or 'ignore'."""

    action: str
    reason: str


# ---- comparing replies ----


def compared_keys(method: str, stage: int, num_stages: int) -> Tuple[str, ...]:
    """What a reply holds that another replica can recompute: forward outputs (the loss on the last
    stage), and the input gradient (above stage 0) and loss (last stage) of a backward. Stage 0's
    backward returns nothing checkable: its parameter gradients never leave the replica."""
    last = stage == num_stages - 1
    if method == "forward":
        return ("loss",) if last else ("outputs",)
    if method == "backward":
        return (("grad_inputs",) if stage > 0 else ()) + (("loss",) if last else ())
    return ()


def params_step(method: str, reply: Mapping[str, Any]) -> Optional[int]:
    """The step of the parameters a reply was computed with, if it says so: ``step`` of a forward reply,
    ``params_step`` of a backward one (whose ``step`` is the step its gradients accumulate into)."""
    value = reply.get("step" if method == "forward" else "params_step")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _distance(a: Any, b: Any) -> float:
    """Relative L2 distance of two tensors or numbers; inf if they cannot be compared at all."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return math.inf
        a, b = a.double(), b.double()
        scale = max(float(a.norm()), float(b.norm()))
        difference = float((a - b).norm())
    elif (
        isinstance(a, (int, float))
        and isinstance(b, (int, float))
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        scale, difference = max(abs(a), abs(b)), abs(a - b)
    else:
        return math.inf
    if not math.isfinite(difference):
        return math.inf
    return 0.0 if difference == 0 else difference / scale


def replies_agree(a: Mapping[str, Any], b: Mapping[str, Any], keys: Sequence[str], rtol: float) -> bool:
    """Whether every compared value of ``a`` is within ``rtol`` (relative L2 distance) of ``b``'s."""
    return all(_distance(a.get(key), b.get(key)) <= rtol for key in keys)


def compare(a: Observation, b: Observation, keys: Sequence[str], rtol: float) -> Verdict:
    """Two replicas' replies to the same request: comparable only when computed at the same step."""
    if a.step is None or b.step is None or a.step != b.step:
        return Verdict("incomparable", f"steps {a.step} and {b.step}")
    if not _same_parameters((a, b)):
        return Verdict("incomparable", f"parameters {a.digest} and {b.digest} at step {a.step}")
    if replies_agree(a.reply, b.reply, keys, rtol):
        return Verdict("agree")
    distances = ", ".join(f"{key} {_distance(a.reply.get(key), b.reply.get(key)):.3g}" for key in keys)
    return Verdict("disagree", f"relative distance {distances} at step {a.step}")


def outvoted(observations: Sequence[Observation], keys: Sequence[str], rtol: float) -> Optional[Observation]:
    """Of three replies at one step, the one that disagrees with two that agree; None if there is no such
    majority (other steps, fewer replies, three different replies, or all three agreeing)."""
    if len(observations) != 3 or observations[0].step is None or not _same_parameters(observations):
        return None
    for index, suspect in enumerate(observations):
        a, b = (o for i, o in enumerate(observations) if i != index)
        if (
            replies_agree(a.reply, b.reply, keys, rtol)
            and not replies_agree(suspect.reply, a.reply, keys, rtol)
            and not replies_agree(suspect.reply, b.reply, keys, rtol)
        ):
            return suspect
    return None


def blame_incomparable(steps: Sequence[Optional[int]], announced: Sequence[int], max_lag: int) -> List[int]:
    """Which of the replies that could not be compared to each other is to blame: one without a step, or
    one whose step is more than ``max_lag`` from the lower median of its stage's announced steps, when
    the other is not. Nobody when both or neither are (a step just closed: nobody's fault)."""
    median = sorted(announced)[(len(announced) - 1) // 2] if announced else None

    def off(step: Optional[int]) -> bool:
        return step is None or (median is not None and abs(step - median) > max_lag)

    offs = [off(step) for step in steps]
    return [index for index, is_off in enumerate(offs) if is_off] if 0 < sum(offs) < len(offs) else []


def fingerprint(reply: Mapping[str, Any], keys: Sequence[str]) -> str:
    """A short hash of the compared values of a reply: evidence that names a reply without holding it."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for key in keys:
        _hash_value(h, key, reply.get(key))
    return h.hexdigest()


def request_fingerprint(message: Mapping[str, Any]) -> str:
    """A short hash of what a stage computes from: its inputs, the output gradient and the targets."""
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    for key in ("inputs", "grad_outputs", "targets"):
        _hash_value(h, key, message.get(key))
    return h.hexdigest()


def _hash_value(h: Any, key: str, value: Any) -> None:
    h.update(key.encode())
    if isinstance(value, torch.Tensor):
        h.update(f"{value.dtype}{tuple(value.shape)}".encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    else:
        h.update(repr(value).encode())


# ---- what one trainer remembers ----


@dataclass
class _Pending:
    """An accusation this reader is checking for itself."""

    accused: str
    stage: int
    until: float
    checks: int = 0


class VerificationBook:
    """One trainer's memory of checks and accusations: suspects, strikes, accusations being checked and
    the credit of their authors. No I/O and no clock: every method takes ``now``. Memory is bounded
    (:data:`MAX_REMEMBERED` entries per table, oldest dropped)."""

    def __init__(self, policy: VerificationPolicy, own_id: str = ""):
        self.policy, self.own_id = policy, own_id
        self._suspected_until: "OrderedDict[str, float]" = OrderedDict()
        self._strikes: Dict[str, int] = {}
        self._pending: "OrderedDict[str, _Pending]" = OrderedDict()  # author -> its accusation being checked
        self._credit: "OrderedDict[str, int]" = OrderedDict()  # author -> confirmed minus refuted accusations
        self._seen: "OrderedDict[Tuple, None]" = OrderedDict()

    # -- checking replies --

    def is_suspected(self, peer_id: str, now: float) -> bool:
        return now < self._suspected_until.get(peer_id, -math.inf)

    def should_verify(self, peer_id: str, now: float, draw: float) -> bool:
        """Whether to check this reply of ``peer_id``, given a uniform ``draw`` in [0, 1)."""
        suspected = self.is_suspected(peer_id, now)
        return draw < (self.policy.suspect_fraction if suspected else self.policy.verify_fraction)

    def suspect(self, peer_id: str, now: float) -> None:
        until = max(self._suspected_until.pop(peer_id, -math.inf), now + self.policy.suspicion_s)
        _put(self._suspected_until, peer_id, until)

    def agreed(self, peer_ids: Sequence[str]) -> None:
        """Replies of these replicas were compared and agreed: their strikes end, and each such check of
        an accused replica counts towards refuting its accusation."""
        for peer_id in peer_ids:
            self._strikes.pop(peer_id, None)
            for pending in self._pending.values():
                if pending.accused == peer_id:
                    pending.checks += 1

    def strike(self, peer_id: str) -> bool:
        """A check failed because of this replica's step; True once it has ``max_strikes`` in a row."""
        strikes = self._strikes.get(peer_id, 0) + 1
        if strikes >= self.policy.max_strikes:
            self._strikes.pop(peer_id, None)
            return True
        if len(self._strikes) < MAX_REMEMBERED:
            self._strikes[peer_id] = strikes
        return False

    def caught(self, peer_id: str) -> List[str]:
        """This trainer outvoted ``peer_id`` itself: every accusation of it being checked is confirmed;
        returns their authors (whose credit grows)."""
        confirmed = [author for author, pending in self._pending.items() if pending.accused == peer_id]
        for author in confirmed:
            del self._pending[author]
            _put(self._credit, author, self._credit.pop(author, 0) + 1)
        self._suspected_until.pop(peer_id, None)
        return confirmed

    # -- accusations of other trainers --

    def is_credible(self, author: str) -> bool:
        return self._credit.get(author, 0) > -self.policy.max_refuted

    def consider(self, author: str, accused: str, stage: int, evidence: Tuple, now: float) -> AccusationVerdict:
        """An accusation read from the DHT (``evidence`` tells accusations apart): suspect the accused
        (check it more often, and judge the accusation by those checks) or ignore it, with the reason."""
        key = (author, accused, stage, *evidence)
        if key in self._seen:
            return AccusationVerdict("ignore", "already seen")
        if author == self.own_id:
            return AccusationVerdict("ignore", "this trainer's own accusation")
        if not self.is_credible(author):
            _put(self._seen, key, None)
            return AccusationVerdict(
                "ignore", f"its author {author} has had {-self._credit[author]} more accusations refuted than confirmed"
            )
        if author in self._pending:  # one accusation per author at a time bounds what each author costs
            return AccusationVerdict("ignore", f"an earlier accusation of {author} is still being checked")
        _put(self._seen, key, None)
        _put(self._pending, author, _Pending(accused, stage, now + self.policy.suspicion_s))
        self.suspect(accused, now)
        return AccusationVerdict("suspect", f"accused by {author}")

    def expire(self, now: float) -> List[Tuple[str, str, bool]]:
        """Close the accusations whose suspicion is over: ``(author, accused, refuted)`` for each; one
        whose accused was checked ``min_checks`` times without a mismatch is refuted and costs its
        author one credit (one checked fewer times is dropped, undecided)."""
        closed = []
        for author, pending in list(self._pending.items()):
            if now < pending.until:
                continue
            del self._pending[author]
            refuted = pending.checks >= self.policy.min_checks
            if refuted:
                _put(self._credit, author, self._credit.pop(author, 0) - 1)
            closed.append((author, pending.accused, refuted))
        for peer_id in [p for p, until in self._suspected_until.items() if until <= now]:
            del self._suspected_until[peer_id]
        return closed


def _put(table: "OrderedDict", key: Any, value: Any) -> None:
    """Insert as the newest entry, dropping the oldest beyond :data:`MAX_REMEMBERED`."""
    table.pop(key, None)
    table[key] = value
    while len(table) > MAX_REMEMBERED:
        table.popitem(last=False)
