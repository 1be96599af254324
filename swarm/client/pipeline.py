"""Sends one micro-batch through every stage of the swarm: forward, then backward in reverse.

The trainer relays activations between stages (as in SWARM): it sends stage k's output to a
replica of stage k+1 chosen by throughput-weighted stochastic wiring, and keeps each stage's
input so that any replica can run that stage's backward (recomputing the forward if it must). A
stage's backward goes back to the replica that ran its forward while that one is eligible: it may
still hold the forward's graph and skip the recomputation.
Each call has a timeout; a failed or slow replica is banned with backoff and the call is
retried on another replica of the same stage, a bounded number of times.

Every reply is checked (:func:`check_reply`) the moment it arrives, before anything uses it: a
replica that sends a malformed, wrongly shaped or non-finite reply is banned and the call goes
to another replica, so a bad output of stage k is blamed on stage k's replica, never on the
replica of stage k+1 that would have received it. A wrong but well-formed reply passes these
checks; with defences on, the trainer's :class:`swarm.client.verification.ReplyVerifier` spot-checks
replies on other replicas and hands back the majority's reply where the first one was outvoted.

With the run's ``compression``, the activations and gradients of forward and backward requests travel
compressed (the stage's replies too: see :mod:`swarm.server.handlers`), and arrive as float32 either
way. The trainer keeps the decoded activations it received, so a stage's backward recomputes its
forward from exactly the inputs its forward saw.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_logger

from swarm.client.attacks import TrainerAttack
from swarm.client.ledger import Contribution, Ledger
from swarm.net.compression import DEFAULT_BLOCK_SIZE, check_block_size, check_codec, gradient_codec, num_blocks
from swarm.model.finite import all_finite
from swarm.metrics import count_ban
from swarm.model.gpt import ModelConfig
from swarm.policy.routing import NoPeerAvailable, Router
from swarm.policy.snapshot import PeerInfo
from swarm.net.dialing import is_routing_failure
from swarm.net.rpc import RemoteError, call_peer


class ReplyChecker(Protocol):
    """Spot-checks a replica's reply on other replicas (:class:`swarm.client.verification.ReplyVerifier`)."""

    async def check(
        self, stage: int, method: str, message: Mapping[str, Any], reply: Dict[str, Any], peer_id: str, timeout: float
    ) -> Dict[str, Any]: ...


__all__ = [
    "PipelineClient",
    "StageUnavailable",
    "Unauthorized",
    "BadReply",
    "FailureVerdict",
    "check_reply",
    "judge_failure",
    "HIDDEN_DTYPE",
]

logger = get_logger(__name__)
HIDDEN_DTYPE = torch.float32  # swarm.model.gpt builds every stage in torch's default dtype: hidden states are float32
REPLY_SLACK_BYTES = 2**20  # bytes a reply may take beyond its tensors (keys, a loss, a step, an error message)


class StageUnavailable(RuntimeError):
    """No replica of a stage completed a call within the allowed retries."""


class Unauthorized(RuntimeError):
    """A replica refused this trainer: it is not allowed to take part in the run."""


class BadReply(RuntimeError):
    """A replica answered, but with a reply that fails :func:`check_reply`."""

    def __init__(self, peer_id: str, stage: int, reason: str):
        super().__init__(f"peer {peer_id} of stage {stage} sent a bad reply: {reason}")
        self.peer_id, self.stage, self.reason = peer_id, stage, reason


def encoded_float_bytes(elements: int, compression: str, block_size: int) -> int:
    """Bytes ``elements`` float32 values take on the wire in ``compression`` (data and the blocks' scales)."""
    if compression == "fp16":
        return 2 * elements
    if compression == "int8":
        return elements + 4 * num_blocks(elements, block_size)
    if compression == "int4":
        return -(-elements // 2) + 4 * num_blocks(elements, block_size)
    return HIDDEN_DTYPE.itemsize * elements


# ---- checking replies (pure) ----


def check_reply(
    reply: Any, *, stage: int, num_stages: int, method: str, inputs: Any, wire_width: int, logits_of: int = 0
) -> Optional[str]:
    """Why ``reply`` to ``method`` on ``stage`` (called with ``inputs``) cannot be used, or None if it can.

    Forward below the last stage: finite ``outputs`` of shape (batch, seq_len, wire_width) in
    :data:`HIDDEN_DTYPE`. Forward of the last stage: a finite ``loss`` (evaluation), or, when the request asked
    for the logits of a vocabulary of ``logits_of`` tokens (generation), finite ``logits`` of shape (batch,
    logits_of) in :data:`HIDDEN_DTYPE`. Backward: a ``step``; on the last stage also a ``loss``; above stage 0
    also finite ``grad_inputs`` of the inputs' shape and dtype."""
    if not isinstance(reply, Mapping):
        return f"the reply is a {type(reply).__name__}, not a map"
    last = stage == num_stages - 1
    if method == "forward":
        if last and logits_of:
            return _check_tensor(reply, "logits", (int(inputs.shape[0]), logits_of), HIDDEN_DTYPE)
        if last:
            return _check_loss(reply)
        expected = (*tuple(inputs.shape[:2]), wire_width)
        return _check_tensor(reply, "outputs", expected, HIDDEN_DTYPE)
    if method == "backward":
        reasons = [_check_count(reply, "step"), _check_count(reply, "resets")]
        if last:
            reasons.append(_check_loss(reply))
        if stage > 0:
            reasons.append(_check_tensor(reply, "grad_inputs", tuple(inputs.shape), inputs.dtype))
        return next((reason for reason in reasons if reason is not None), None)
    return None


def _check_tensor(reply: Mapping, key: str, shape: Tuple[int, ...], dtype: torch.dtype) -> Optional[str]:
    value = reply.get(key)
    if not isinstance(value, torch.Tensor):
        return f"{key!r} is missing" if value is None else f"{key!r} is a {type(value).__name__}, not a tensor"
    if value.dtype != dtype:
        return f"{key!r} has dtype {value.dtype}, expected {dtype}"
    if tuple(value.shape) != tuple(shape):
        return f"{key!r} has shape {tuple(value.shape)}, expected {tuple(shape)}"
    if not all_finite(value):
        return f"{key!r} contains NaN or inf values"
    return None


def _check_loss(reply: Mapping) -> Optional[str]:
    loss = reply.get("loss")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)):
        return "'loss' is missing" if loss is None else f"'loss' is a {type(loss).__name__}, not a number"
    if not math.isfinite(loss) or loss < 0:  # the objective is a mean cross-entropy: finite and >= 0
        return f"'loss' is {loss!r}, not a finite non-negative number"
    return None


def _check_count(reply: Mapping, key: str) -> Optional[str]:
    value = reply.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return f"'{key}' is missing" if value is None else f"'{key}' is {value!r}, not a non-negative integer"
    return None


# ---- what a failed call means (pure) ----


@dataclass(frozen=True)
class FailureVerdict:
    """What to do with the replica after a failed call: ``action`` is 'ban' (with backoff), 'pause'
    (set aside briefly, not counted as a failure) or 'refuse' (fail the call: retrying cannot help)."""

    action: str
    reason: str
    stale_snapshot: bool = False  # the replica serves another stage: re-read the swarm
    # a fixed word for the failure (metrics): bad_reply, timeout, unreachable or a RemoteError kind
    kind: str = "failed_call"


def judge_failure(error: BaseException) -> FailureVerdict:
    """Decide how a failed call reflects on the replica that was called.

    A 'bad_request' for a request built from validated replies means the transfer or that replica
    is at fault, so it is banned and the call goes elsewhere like any other failure; the retry
    bound still ends a request that every replica refuses."""
    if isinstance(error, BadReply):
        return FailureVerdict("ban", f"bad reply: {error.reason}", kind="bad_reply")
    if isinstance(error, RemoteError):
        reason = f"{error.kind}: {error}"
        if error.kind == "unauthorized":
            return FailureVerdict("refuse", reason, kind=error.kind)
        if error.kind == "busy":
            return FailureVerdict("pause", reason, kind=error.kind)
        return FailureVerdict("ban", reason, stale_snapshot=error.kind == "wrong_stage", kind=error.kind)
    if isinstance(error, asyncio.TimeoutError):
        return FailureVerdict("ban", "timed out", kind="timeout")
    if is_routing_failure(error):  # this host could not find or dial it: no evidence against the peer
        return FailureVerdict("pause", f"unreachable from here ({type(error).__name__}: {error})", kind="unreachable")
    return FailureVerdict("ban", f"{type(error).__name__}: {error}")


class PipelineClient:
    """Routes calls to stage replicas; ``snapshot()`` returns the current peers (refreshed elsewhere).

    Runs in the trainer's event loop; ``model`` gives the hidden size that replies are checked against;
    requests go in the run's ``compression`` (blocks of ``block_size`` values for int8)."""

    def __init__(
        self,
        p2p: P2P,
        num_stages: int,
        snapshot: Callable[[], Sequence[PeerInfo]],
        router: Router,
        ledger: Ledger,
        *,
        model: ModelConfig,
        forward_timeout_s: float,
        backward_timeout_s: float,
        max_retries: int,
        on_stale_snapshot: Optional[Callable[[int], None]] = None,
        on_ledger_fields: Optional[Callable[[str, int, Any], None]] = None,
        busy_pause_s: float = 0.5,
        compression: str = "none",
        block_size: int = DEFAULT_BLOCK_SIZE,
    ):
        self.p2p, self.num_stages, self.snapshot, self.router, self.ledger = p2p, num_stages, snapshot, router, ledger
        self.model = model
        self.compression, self.block_size = check_codec(compression), check_block_size(block_size)
        self.forward_timeout_s, self.backward_timeout_s, self.max_retries = (
            forward_timeout_s,
            backward_timeout_s,
            max_retries,
        )
        # a call found the snapshot of a stage stale (a dead or moved peer): called with the stage
        self.on_stale_snapshot = on_stale_snapshot or (lambda stage: None)
        # a backward reply carried the replica's ledger fields (swarm.dht.ledger_fields): called with its peer id,
        # stage and those fields
        self.on_ledger_fields = on_ledger_fields or (lambda peer_id, stage, fields: None)
        self.busy_pause_s = busy_pause_s
        self.verifier: Optional[ReplyChecker] = None  # spot-checks replies on other replicas (set by the trainer)
        self.attack = TrainerAttack()  # what an emulated poisoning trainer does to its gradients (set by the trainer)
        self.in_flight: Dict[str, int] = {}  # peer id -> this trainer's calls to it under way (routing weighs them)

    async def call_stage(
        self, stage: int, method: str, message: Dict[str, Any], timeout: float, prefer: Optional[str] = None
    ) -> Tuple[Dict[str, Any], str]:
        """Call ``method`` on some replica of ``stage``, ``prefer`` first while it is eligible (see
        :func:`swarm.policy.routing.preferred_replica`); returns a checked reply and the replica's peer id."""
        tried: List[str] = []
        errors: List[str] = []  # one per failed call, first (usually the most telling) first
        no_peer: Optional[str] = None
        for attempt in range(self.max_retries):
            candidates = [p for p in self.snapshot() if p.stage == stage]
            exclude = tried if len(set(tried)) < len(candidates) else ()
            try:
                peer = self.router.choose(
                    candidates, time.monotonic(), exclude=exclude, prefer=prefer, in_flight=self.in_flight
                )
            except NoPeerAvailable as e:
                no_peer = str(e)
                self.on_stale_snapshot(stage)
                await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
                continue
            try:
                reply = await self._attempt(peer.peer_id, stage, method, message, timeout)
            except Exception as e:  # timeouts, dead peers, broken streams, error replies, bad replies
                errors.append(self._on_failure(peer.peer_id, stage, method, e, first=not errors))
                tried.append(peer.peer_id)
                continue
            return reply, peer.peer_id
        raise StageUnavailable(_summary(stage, method, self.max_retries, errors, no_peer))

    async def _attempt(
        self, peer_id: str, stage: int, method: str, message: Dict[str, Any], timeout: float
    ) -> Dict[str, Any]:
        """One call to one replica; returns its checked reply, raises whatever went wrong."""
        started = time.monotonic()
        self.in_flight[peer_id] = self.in_flight.get(peer_id, 0) + 1
        try:
            reply = await call_peer(
                self.p2p,
                PeerID.from_base58(peer_id),
                method,
                {**message, "stage": stage},
                timeout=timeout,
                max_reply_bytes=self._reply_limit(message),
                compression=self.compression,
                block_size=self.block_size,
                expected_reply_bytes=self._expected_reply_bytes(stage, method, message),
                direct=True,
            )
        finally:
            remaining = self.in_flight.pop(peer_id) - 1
            if remaining:
                self.in_flight[peer_id] = remaining
        self._check(peer_id, stage, method, message, reply)
        self.router.report_success(peer_id, _samples(message), time.monotonic() - started, kind=method)
        return reply

    def choose_replica(self, stage: int, exclude: Collection[str]) -> Optional[str]:
        """A replica of ``stage`` other than ``exclude``, drawn as calls are; None if there is none."""
        candidates = [p for p in self.snapshot() if p.stage == stage]
        try:
            return self.router.choose(candidates, time.monotonic(), exclude=exclude, in_flight=self.in_flight).peer_id
        except NoPeerAvailable:
            return None

    async def call_replica(
        self, peer_id: str, stage: int, method: str, message: Dict[str, Any], timeout: float
    ) -> Optional[Dict[str, Any]]:
        """Call one given replica once (no retries); its checked reply, or None if the call failed (the
        replica is then treated as after any failed call: banned, or set aside if busy)."""
        try:
            return await self._attempt(peer_id, stage, method, message, timeout)
        except Exception as e:
            try:
                self._on_failure(peer_id, stage, method, e, first=True)
            except Unauthorized as refused:
                logger.warning(str(refused))
            return None

    async def _verified(
        self, stage: int, method: str, message: Dict[str, Any], reply: Dict[str, Any], peer_id: str, timeout: float
    ) -> Dict[str, Any]:
        """The reply to use: ``reply``, or the majority's where a spot check outvoted ``peer_id``."""
        if self.verifier is None:
            return reply
        return await self.verifier.check(stage, method, message, reply, peer_id, timeout)

    def _reply_limit(self, message: Mapping[str, Any]) -> int:
        """Bytes a reply may take: twice the largest tensor a valid reply holds (the stage's inputs or
        hidden states of the same batch), plus room for the envelope, so that no replica can make this
        trainer buffer a reply far larger than any valid one."""
        inputs = message.get("inputs")
        if not isinstance(inputs, torch.Tensor) or inputs.ndim < 2:
            return REPLY_SLACK_BYTES
        hidden = int(inputs.shape[0]) * int(inputs.shape[1]) * self.model.wire_width * HIDDEN_DTYPE.itemsize
        return 2 * max(hidden, inputs.numel() * inputs.element_size()) + REPLY_SLACK_BYTES

    def _expected_reply_bytes(self, stage: int, method: str, message: Mapping[str, Any]) -> int:
        """Encoded bytes of the tensor a valid reply carries (hidden states of a forward, gradients of the
        inputs of a backward), in the run's compression: how the call picks unary or stream up front."""
        inputs = message.get("inputs")
        if not isinstance(inputs, torch.Tensor) or inputs.ndim < 2:
            return 0
        if method == "forward" and stage < self.num_stages - 1:
            elements = int(inputs.shape[0]) * int(inputs.shape[1]) * self.model.wire_width
            return encoded_float_bytes(elements, self.compression, self.block_size)
        if method == "backward" and stage > 0:  # the gradients of the inputs
            return encoded_float_bytes(inputs.numel(), gradient_codec(self.compression), self.block_size)
        return 0

    def _check(self, peer_id: str, stage: int, method: str, message: Mapping[str, Any], reply: Any) -> None:
        reason = check_reply(
            reply,
            stage=stage,
            num_stages=self.num_stages,
            method=method,
            inputs=message.get("inputs"),
            wire_width=self.model.wire_width,
            logits_of=self.model.vocab_size if message.get("logits") is True else 0,
        )
        if reason is not None:
            raise BadReply(peer_id, stage, reason)

    def _on_failure(self, peer_id: str, stage: int, method: str, error: Exception, first: bool) -> str:
        """Act on :func:`judge_failure`'s verdict; returns the failure's description."""
        verdict = judge_failure(error)
        now = time.monotonic()
        if verdict.action == "pause":
            self.router.ban(peer_id, now, duration_s=self.busy_pause_s)
        else:
            self.router.ban(peer_id, now)
        count_ban("trainer", verdict.kind if verdict.action == "ban" else f"{verdict.action}_{verdict.kind}")
        if verdict.stale_snapshot:
            self.on_stale_snapshot(stage)
        description = f"{peer_id}: {verdict.reason}"
        if isinstance(error, BadReply):
            logger.warning(f"banning peer {peer_id} of stage {stage}: {error.reason}")
        elif first:
            logger.warning(f"stage {stage} {method} failed on {description}; trying another replica")
        else:
            logger.info(f"stage {stage} {method} failed again on {description}")
        if verdict.action == "refuse":
            raise Unauthorized(
                f"stage {stage} refused this trainer ({description}): this trainer is not allowed "
                f"in the run; check its identity and the run's allowlist"
            ) from error
        return description

    async def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward only, through all stages; the last stage returns the loss."""
        x = inputs
        for stage in range(self.num_stages - 1):
            reply, _ = await self.call_stage(stage, "forward", {"inputs": x}, self.forward_timeout_s)
            x = reply["outputs"]
        reply, _ = await self.call_stage(
            self.num_stages - 1, "forward", {"inputs": x, "targets": targets}, self.forward_timeout_s
        )
        return float(reply["loss"])

    async def train_step(self, micro_batch_id: str, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of one micro-batch; every stage's contribution goes into the ledger."""
        stage_inputs, forward_peers = [inputs], []
        for stage in range(self.num_stages - 1):
            # the id lets the replica keep this forward's graph for the backward that comes back to it
            message = {"inputs": stage_inputs[-1], "micro_batch_id": micro_batch_id}
            reply, peer_id = await self.call_stage(stage, "forward", message, self.forward_timeout_s)
            reply = await self._verified(stage, "forward", message, reply, peer_id, self.forward_timeout_s)
            stage_inputs.append(reply["outputs"])
            forward_peers.append(peer_id)
        last = self.num_stages - 1
        item = Contribution(micro_batch_id, last, "", 0, int(inputs.shape[0]), stage_inputs[last], None, targets)
        reply = await self.backward(item)
        loss = float(reply["loss"])
        grad = self.attack.last_grad_inputs(reply.get("grad_inputs"))
        clock_step = int(reply["step"])  # checked by check_reply; tells the other stages the clock moved on
        for stage in reversed(range(last)):
            item = Contribution(micro_batch_id, stage, "", 0, int(inputs.shape[0]), stage_inputs[stage], grad, None)
            reply = await self._backward_persistently(item, prefer=forward_peers[stage], clock_step=clock_step)
            grad = reply.get("grad_inputs")
        return loss

    async def _backward_persistently(
        self, item: Contribution, rounds: int = 3, prefer: Optional[str] = None, clock_step: Optional[int] = None
    ) -> Dict[str, Any]:
        """Backward of a stage below the last: the stages above already counted this micro-batch,
        so giving up would leave them with samples this stage never saw. Retry a few rounds (a
        stage can be briefly without replicas while a peer moves) before failing the micro-batch."""
        for attempt in range(rounds - 1):
            try:
                return await self.backward(item, prefer=prefer, clock_step=clock_step)
            except StageUnavailable as e:
                logger.warning(f"backward of {item.micro_batch_id} at stage {item.stage} failed, retrying: {e}")
                await asyncio.sleep(min(2.0 * 2**attempt, 10.0))
        return await self.backward(item, prefer=prefer, clock_step=clock_step)

    async def backward(
        self,
        item: Contribution,
        resend: bool = False,
        prefer: Optional[str] = None,
        clock_step: Optional[int] = None,
    ) -> Dict[str, Any]:
        """Run (or re-run) one stage's backward for a contribution and record where it landed; ``prefer``
        is the replica that ran the micro-batch's forward (it may skip recomputing it); ``clock_step`` the step
        the last stage accumulated the micro-batch into (the replica learns from it when the clock moved on)."""
        message: Dict[str, Any] = {"micro_batch_id": item.micro_batch_id, "inputs": item.inputs}
        if clock_step is not None:
            message["clock_step"] = clock_step
        if item.grad_outputs is not None:
            message["grad_outputs"] = item.grad_outputs
        if item.targets is not None:
            message["targets"] = item.targets
        reply, peer_id = await self.call_stage(item.stage, "backward", message, self.backward_timeout_s, prefer=prefer)
        resets = reply["resets"]  # checked by check_reply
        if "ledger_fields" in reply:
            self.on_ledger_fields(peer_id, item.stage, reply["ledger_fields"])
        if resend:
            self.ledger.resent(item, peer_id, reply["step"], resets)
            return reply
        item.peer_id, item.step, item.resets = peer_id, reply["step"], resets
        self.ledger.add(item)
        return await self._verified(item.stage, "backward", message, reply, peer_id, self.backward_timeout_s)


def _samples(message: Mapping[str, Any]) -> int:
    inputs = message.get("inputs")
    return int(inputs.shape[0]) if isinstance(inputs, torch.Tensor) and inputs.ndim >= 1 else 0


def _summary(stage: int, method: str, attempts: int, errors: Sequence[str], no_peer: Optional[str]) -> str:
    """Why a call failed, leading with the first real error: "no peer available" is what remains once
    every replica was banned for failing, so it only explains a call where no replica was reached."""
    where = f"stage {stage}: {method} failed after {attempts} attempts"
    if not errors:
        return f"{where}: {no_peer or 'no attempt made'}"
    text = f"{where}; first error: {errors[0]}"
    if len(errors) > 1 and errors[-1] != errors[0]:
        text += f"; last error: {errors[-1]}"
    return text + (f" ({len(errors)} calls failed)" if len(errors) > 1 else "")
