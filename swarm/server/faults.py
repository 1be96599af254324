"""Emulated faulty replicas: a peer that corrupts its replies, its gradients or its state on purpose.

Tests and benchmarks use them to check that trainers and stage-mates detect the fault, ban the peer that
has it and carry on. A fault is installed on a peer from outside (:func:`install_fault`, which
``swarm faulty_peer`` calls before the peer starts): it wraps the peer's handlers, swaps in an averager
that changes what the replica contributes, or corrupts the state it serves. Nothing of this module runs
in an honest peer, and no honest code path asks whether it is faulty.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Dict, List, Optional, Tuple

import torch

from swarm.server.averaging import StageAverager

if TYPE_CHECKING:
    from swarm.server.peer import StagePeer

__all__ = [
    "FAULTS",
    "REPLY_FAULTS",
    "GRADIENT_FAULTS",
    "STATE_FAULTS",
    "corrupt_reply",
    "GradientFault",
    "corrupt_state",
    "check_fault",
    "install_fault",
    "FaultyAverager",
]

# faults of the replies to trainers
REPLY_FAULTS = (
    "non_numeric_loss",
    "nan_loss",
    "wrong_loss",
    "nan_outputs",
    "wrong_shape_outputs",
    "missing_step",
    "noisy_outputs",
    "zero_outputs",
    "noisy_grad_inputs",
)
# faults of what the replica contributes to its stage's averaging
GRADIENT_FAULTS = (
    "sign_flip_gradients",
    "same_norm_sign_flip",
    "random_gradients",
    "nan_gradients",
    "little_is_enough",
    "equivocate_gradients",
)
# faults of the state the replica serves to joiners
STATE_FAULTS = ("poisoned_state",)
FAULTS = ("none",) + REPLY_FAULTS + GRADIENT_FAULTS + STATE_FAULTS


def corrupt_reply(fault: str, method: str, reply: Dict[str, Any]) -> Dict[str, Any]:
    """``reply`` as a replica with ``fault`` would send it."""
    if fault == "none":
        return reply
    reply = dict(reply)
    if "loss" in reply and fault == "non_numeric_loss":
        reply["loss"] = "not a number"
    elif "loss" in reply and fault == "nan_loss":
        reply["loss"] = float("nan")
    elif "loss" in reply and fault == "wrong_loss":  # finite and plausible: only a recomputation shows it
        reply["loss"] = 0.5 * float(reply["loss"])
    elif fault == "missing_step" and method == "backward":
        reply.pop("step", None)
    for key in ("outputs", "grad_inputs"):
        value = reply.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        if fault == "nan_outputs":
            reply[key] = torch.full_like(value, float("nan"))
        elif fault == "wrong_shape_outputs":
            reply[key] = value[..., :-1].contiguous() if value.ndim >= 1 and value.shape[-1] > 1 else value.unsqueeze(0)
        elif (fault, key) in (("noisy_outputs", "outputs"), ("noisy_grad_inputs", "grad_inputs")):
            reply[key] = _with_noise(value)
        elif fault == "zero_outputs" and key == "outputs":
            reply[key] = torch.zeros_like(value)
    return reply


def _with_noise(value: torch.Tensor) -> torch.Tensor:
    """``value`` plus Gaussian noise of half its own standard deviation: finite, of the right scale, wrong."""
    std = float(value.float().std()) if value.numel() > 1 else 0.0
    return value + torch.randn_like(value) * (0.5 * std if std > 0 else 1e-3)


class GradientFault:
    """What a replica with one of :data:`GRADIENT_FAULTS` sends to its stage's averaging instead of its gradient.

    ``same_norm_sign_flip`` sends its gradient negated, at its own norm and with its true sample count.
    ``little_is_enough`` (Baruch et al., 2019) stays inside the honest spread: it sends its gradient moved by
    ``z`` standard deviations against itself, the deviation estimated from its own recent gradients.
    ``equivocate_gradients`` sends its true gradient to every other groupmate and a sign-flipped one
    to the rest (see :meth:`send_override`); it needs a round in which it talks to each groupmate directly.

    The two x1000 attacks also lie about their weight: they claim the whole step's samples
    (:meth:`claimed_samples`), the most a self-reported weight can say, so that without the defences'
    bounded weights their vector dominates the stage's mean even while trainers send them little work. A step in
    which they computed nothing (trainers sent them no work: their gradient is zero) does not stop them: they attack
    with the last gradient they had, as an attacker that owes nobody a computation would."""

    WEIGHT_LIARS = ("sign_flip_gradients", "random_gradients")

    SCALE = 1000.0  # the sign flip and the random direction are this many times the gradient's norm
    LITTLE_Z = 1.0  # standard deviations the little-is-enough attack moves

    def __init__(self, fault: str = "none", seed: int = 0):
        self.fault = fault if fault in GRADIENT_FAULTS else "none"
        self.generator = torch.Generator().manual_seed(seed)
        self._mean: Optional[List[torch.Tensor]] = None
        self._square: Optional[List[torch.Tensor]] = None
        self._last: Optional[List[torch.Tensor]] = None  # the weight liars' last non-zero gradient

    def claimed_samples(self, samples: float, step_samples: Optional[float]) -> float:
        """The sample count this replica reports for its contribution: its true ``samples``, or for the
        weight liars the stage's whole step (``step_samples``, the run's target batch) when that is more."""
        if self.fault in self.WEIGHT_LIARS and step_samples is not None:
            return max(float(samples), float(step_samples))
        return float(samples)

    def corrupt(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        if self.fault in self.WEIGHT_LIARS:
            if any(bool(g.any()) for g in grads):
                self._last = [g.clone() for g in grads]
            elif self._last is not None:
                grads = [g.clone() for g in self._last]
        if self.fault == "sign_flip_gradients":
            return [-self.SCALE * g for g in grads]
        if self.fault == "same_norm_sign_flip":  # as far from the honest gradients as one of them: no distance shows it
            return [-g for g in grads]
        if self.fault == "nan_gradients":
            return [torch.full_like(g, float("nan")) for g in grads]
        if self.fault == "random_gradients":
            norm = torch.sqrt(sum(float(g.double().pow(2).sum()) for g in grads) * torch.ones(()))
            noise = [torch.randn(g.shape, generator=self.generator, dtype=g.dtype) for g in grads]
            noise_norm = torch.sqrt(sum(float(n.double().pow(2).sum()) for n in noise) * torch.ones(()))
            return [n * (self.SCALE * norm / noise_norm).to(n.dtype) for n in noise]
        if self.fault == "little_is_enough":
            return self._little_is_enough(grads)
        return grads

    def _little_is_enough(self, grads: List[torch.Tensor]) -> List[torch.Tensor]:
        if self._mean is None or self._square is None:  # both are set together, on the first call
            self._mean = [g.clone() for g in grads]
            self._square = [g * g for g in grads]
        else:
            self._mean = [0.8 * m + 0.2 * g for m, g in zip(self._mean, grads)]
            self._square = [0.8 * s + 0.2 * g * g for s, g in zip(self._square, grads)]
        std = [torch.sqrt(torch.clamp(s - m * m, min=0.0)) for s, m in zip(self._square, self._mean)]
        std = [torch.where(d > 0, d, g.abs()) for d, g in zip(std, grads)]  # no history yet: the gradient's own size
        return [g - self.LITTLE_Z * torch.sign(g) * d for g, d in zip(grads, std)]

    def send_override(self) -> Optional[Callable[[int, torch.Tensor], torch.Tensor]]:
        """For an equivocator: the vector to send to the ``index``-th other member of the group."""
        if self.fault != "equivocate_gradients":
            return None
        return lambda index, vector: vector if index % 2 == 0 else -self.SCALE * vector


# standard deviation of the noise a "poisoned_state" replica adds to the parameters it serves
POISON_NOISE_STD = 1.0


def corrupt_state(
    fault: str, metadata: Dict[str, Any], tensors: List[torch.Tensor]
) -> tuple[Dict[str, Any], List[torch.Tensor]]:
    """The (metadata, tensors) a replica with ``fault`` serves to replicas that download its state.

    A "poisoned_state" replica adds large noise to the parameters (the first third of the state, as
    :meth:`StageRunner.state_tensors` lays it out: parameters, two AdamW moments each, the step count)
    while its record keeps announcing the digest of its true parameters."""
    if fault != "poisoned_state":
        return metadata, tensors
    num_params = (len(tensors) - 1) // 3
    poisoned = [t + POISON_NOISE_STD * torch.randn_like(t) for t in tensors[:num_params]]
    return metadata, poisoned + list(tensors[num_params:])


def check_fault(fault: str) -> str:
    """``fault`` if it names an emulated fault; ``ValueError`` naming the choices otherwise."""
    if fault not in FAULTS:
        raise ValueError(f"fault must be one of {list(FAULTS)}, got {fault!r}")
    return fault


Handler = Callable[[Dict[str, Any], str], Awaitable[Dict[str, Any]]]


def _corrupting(fault: str, method: str, handler: Handler) -> Handler:
    async def corrupted(request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        return corrupt_reply(fault, method, await handler(request, caller))

    return corrupted


class _CorruptedHandlers:
    """The peer's handlers with the replies of forward and backward corrupted by ``fault``."""

    def __init__(self, handlers: Any, fault: str):
        self._handlers, self._fault = handlers, fault

    def table(self) -> Dict[str, Any]:
        table = dict(self._handlers.table())
        for method in ("forward", "backward"):
            table[method] = _corrupting(self._fault, method, table[method])
        return table


class FaultyAverager(StageAverager):
    """An averager whose replica contributes what :class:`GradientFault` makes of its gradient, and that bids
    to serve its (corrupted) state first: hivemind's downloader picks the replica declaring the highest
    priority, and honest replicas declare 0."""

    def __init__(self, *args: Any, fault: str, **kwargs: Any):
        self._gradient_fault = GradientFault(fault)
        super().__init__(*args, **kwargs)
        if fault in STATE_FAULTS:
            self.state_sharing_priority = 1.0

    def contribution(self, mean_grads: List[torch.Tensor], samples: int) -> Tuple[List[torch.Tensor], float]:
        fault = self._gradient_fault
        return fault.corrupt(list(mean_grads)), fault.claimed_samples(samples, self._max_samples)

    def send_override(self) -> Optional[Callable[[int, torch.Tensor], torch.Tensor]]:
        return self._gradient_fault.send_override()


def install_fault(peer: "StagePeer", fault: str) -> None:
    """Make ``peer`` (not started yet) behave with ``fault``: its replies, its averaging contribution or the
    state it serves, as the fault says."""
    check_fault(fault)
    if fault in REPLY_FAULTS:
        peer.handlers = _CorruptedHandlers(peer.handlers, fault)
    if fault in GRADIENT_FAULTS or fault in STATE_FAULTS:
        peer.averager_class = functools.partial(FaultyAverager, fault=fault)
    if fault in STATE_FAULTS:
        shared_state = peer.shared_state
        peer.served_state = lambda: corrupt_state(fault, *shared_state())
