"""The RPC methods a stage peer serves: forward, backward, info, parameters, step_members, settings.

Each handler checks its request before any work (state, stage, shapes, the caller's right to the
micro-batch id) and raises ``ValueError``/:class:`RemoteError` for bad input, which the servicer turns
into a 'bad_request' reply; the compute runs on the peer's single compute thread.

Forward and backward replies say which parameters computed them (``step`` of a forward, ``params_step``
of a backward, and ``digest``), so that a trainer compares two replicas' replies only when they used
the same parameters. A backward reply also carries the replica's ``ledger_fields``
(:mod:`swarm.dht.ledger_fields`): the steps it applied and whether its own gradients were in them, which the
trainer's ledger settles by between its reads of the DHT. A backward with ``verify: true`` computes the same
reply without accumulating anything: a trainer checking another replica's reply (it passes the same per-caller
limits as any call). A backward to any stage but the last may carry ``clock_step``, the step the last stage
accumulated the same micro-batch into: that is how a replica learns when the clock stage moved on without
polling it (a hint it confirms with the clock's replicas, :meth:`StepCoordinator.hear_clock_hint`).

A forward that carries a ``micro_batch_id`` is a training forward: the replica keeps its graph (see
:mod:`swarm.server.forward_cache`) so that the micro-batch's backward, if it comes back here, need not
recompute it. Such forwards run alone, not merged with others (see :mod:`swarm.server.batching`); every
other forward, the last stage's included, is merged with those queued at the same time, and so are
backwards on a peer that runs with ``merge_backward``. A forward with ``logits: true`` (last stage only, no
targets, no micro-batch id) returns the next-token logits at each sample's last position instead of a loss:
what a generating client samples from; it runs alone and keeps nothing.

With the run's ``compression``, the replies of :data:`COMPRESSED_METHODS` (activations and their
gradients, the bulk of a run's traffic) travel compressed; everything else a peer sends is exact,
since parameters, states and records must be bit-identical wherever they are compared.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Protocol, Tuple

import torch

from swarm.dht.agreement import settings_reply
from swarm.dht.ledger_fields import ledger_fields_of
from swarm.dht.records import PeerRecord
from swarm.net.rpc import RemoteError
from swarm.server.batching import BackwardBatcher, ForwardBatcher
from swarm.server.host import CurrentStage, Settings, served
from swarm.server.lifecycle import PeerState
from swarm.server.runner import StageRunner
from swarm.server.steps import StepCoordinator

__all__ = ["StageHandlers", "HandlerTable", "check_micro_batch_id", "COMPRESSED_METHODS"]

COMPRESSED_METHODS = frozenset({"forward", "backward"})  # methods whose replies use the run's compression


def check_micro_batch_id(micro_batch_id: Any, caller: str) -> str:
    """A micro-batch id is ``"<caller peer id>:<anything>"``: bound to the trainer that sent it, so nobody can
    take a victim's id first and make a replica drop the victim's gradient as a duplicate."""
    if not isinstance(micro_batch_id, str) or not micro_batch_id:
        raise ValueError("micro_batch_id must be a non-empty string")
    if len(micro_batch_id) > 256:
        raise ValueError("micro_batch_id is longer than 256 characters")
    if not micro_batch_id.startswith(f"{caller}:"):
        raise ValueError(
            f"micro_batch_id {micro_batch_id[:80]!r} does not belong to the caller {caller}: "
            f"ids must start with the caller's peer id and ':'"
        )
    return micro_batch_id


def _batch_size(request: Dict[str, Any]) -> int:
    inputs = request.get("inputs")
    if not isinstance(inputs, torch.Tensor):
        raise ValueError(f"inputs must be a torch.Tensor, got {type(inputs).__name__}")
    if inputs.ndim < 1:
        raise ValueError("inputs must have a batch dimension, got a 0-d tensor")
    return int(inputs.shape[0])


def _stamp(reply: Dict[str, Any], key: str, runner: "StageRunner", before: Tuple[int, str]) -> None:
    """Add the step and digest of the parameters that computed ``reply``, when they are certain: steps are
    applied (and states loaded) on the compute thread that ran the work, so parameters unchanged from
    before the work was queued to after it finished are the ones it used. Otherwise say nothing."""
    if runner.version == before:
        reply[key], reply["digest"] = before


def _verify_flag(request: Dict[str, Any]) -> bool:
    verify = request.get("verify", False)
    if not isinstance(verify, bool):
        raise ValueError(f"verify must be true or false, got {type(verify).__name__}")
    return verify


def _logits_flag(request: Dict[str, Any], micro_batch_id: Any, targets: Any) -> bool:
    """Whether a forward asks for the last stage's logits (``logits: true``) rather than its loss; such a forward
    is for generation: it takes no targets and no micro-batch id, since it trains nothing."""
    logits = request.get("logits", False)
    if not isinstance(logits, bool):
        raise ValueError(f"logits must be true or false, got {type(logits).__name__}")
    if logits and (micro_batch_id is not None or targets is not None):
        raise ValueError(
            "a logits forward takes neither targets nor a micro_batch_id: it computes the next-token "
            "logits and trains nothing"
        )
    return logits


class HandlerTable(Protocol):
    """What serves the peer's RPC methods: :class:`StageHandlers`, or a wrapper of them (an emulated faulty
    replica's, :mod:`swarm.server.faults`)."""

    def table(self) -> Dict[str, Any]: ...


class _Announcer(Protocol):
    def record(self) -> PeerRecord: ...


class HandlersHost(Settings, CurrentStage, Protocol):
    """What the handlers read of the peer: its settings, state and current stage, and the parts that do the work."""

    batcher: Optional[ForwardBatcher]
    backward_batcher: Optional[BackwardBatcher]
    steps: Optional[StepCoordinator]

    @property
    def announcer(self) -> _Announcer: ...

    @property
    def state(self) -> PeerState: ...

    def notify_progress(self) -> None: ...


class StageHandlers:
    """Binds the RPC methods to one peer; ``table()`` is what the servicer serves."""

    def __init__(self, peer: HandlersHost):
        self.peer = peer

    def table(self) -> Dict[str, Any]:
        return {
            "forward": self.forward,
            "backward": self.backward,
            "info": self.info,
            "parameters": self.parameters,
            "step_members": self.step_members,
            "settings": self.settings,
        }

    def _check(self, request: Dict[str, Any]) -> int:
        """Refuse work this peer cannot take now; returns the request's batch size (its ``inputs`` is a tensor)."""
        peer = self.peer
        if peer.state != PeerState.ONLINE:
            raise RemoteError(f"peer is {peer.state.value}, not taking new work", "unavailable")
        if request.get("stage") != peer.stage:
            raise RemoteError(f"this peer serves stage {peer.stage}, not {request.get('stage')!r}", "wrong_stage")
        samples = _batch_size(request)
        if samples > peer.config.max_batch_samples:
            raise ValueError(f"batch of {samples} samples exceeds this peer's limit of {peer.config.max_batch_samples}")
        return samples

    async def forward(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        peer = self.peer
        self._check(request)
        inputs, targets = request["inputs"], request.get("targets")  # _check made sure inputs is a tensor
        micro_batch_id = request.get("micro_batch_id")
        if micro_batch_id is not None:
            check_micro_batch_id(micro_batch_id, caller)
        if _logits_flag(request, micro_batch_id, targets):
            return await self._logits(inputs)
        runner = served(peer.runner, "runner")
        before = runner.version
        with peer.compute.serving():
            if micro_batch_id is not None and runner.forward_cache.enabled and not runner.module.is_last:
                reply: Dict[str, Any] = {
                    "outputs": await peer.compute.run(runner.forward_train, micro_batch_id, inputs)
                }
            else:
                runner.module.check_inputs(inputs, targets)  # refuse bad requests alone, before merging
                batcher = served(peer.batcher, "forward batcher")
                with peer.compute.queue():
                    outputs = await batcher.forward(inputs, targets)
                # the last stage's per-token losses: the request's loss is their mean, merged or alone
                reply = {"loss": float(outputs.mean())} if runner.module.is_last else {"outputs": outputs}
        _stamp(reply, "step", runner, before)
        return reply

    async def _logits(self, inputs: torch.Tensor) -> Dict[str, Any]:
        """The last stage's next-token logits at each sample's last position (a generating client's forward): run
        alone on the compute thread, not merged, and nothing kept or accumulated."""
        peer, runner = self.peer, served(self.peer.runner, "runner")
        before = runner.version
        with peer.compute.serving():
            reply: Dict[str, Any] = {"logits": await peer.compute.run(runner.last_logits, inputs)}
        _stamp(reply, "step", runner, before)
        return reply

    async def backward(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        peer = self.peer
        samples = self._check(request)
        if _verify_flag(request):
            return await self._verify_backward(request)
        micro_batch_id = check_micro_batch_id(request.get("micro_batch_id"), caller)
        steps, runner = served(peer.steps, "step coordinator"), served(peer.runner, "runner")
        if "clock_step" in request:  # where the clock stage put this micro-batch: tells when the clock moved on
            steps.hear_clock_hint(request["clock_step"])
        admitted = False
        # a caller that gives up (its call cancelled) while this waits for room leaves nothing in flight
        with peer.compute.serving():
            try:
                await steps.wait_for_room(samples)
                admitted = True
                before, resets = runner.version, runner.resets
                args = (micro_batch_id, request.get("inputs"), request.get("grad_outputs"), request.get("targets"))
                if peer.backward_batcher is not None:
                    with peer.compute.queue():
                        grad_inputs, loss, step = await peer.backward_batcher.backward(*args)
                else:
                    grad_inputs, loss, step = await peer.compute.run(runner.backward, *args)
            finally:
                if admitted:
                    steps.release(samples)
        peer.notify_progress()
        # the adoptions counted before the work was queued: if one came meanwhile, the work may have landed
        # before it (and been dropped) or after; the older count makes the trainer re-send it in doubt
        reply = _backward_reply(grad_inputs, loss, step, runner, before, resets)
        if peer.state != PeerState.STOPPED:  # a stopped peer has no record to take them from
            reply["ledger_fields"] = ledger_fields_of(peer.announcer.record())
        return reply

    async def _verify_backward(self, request: Dict[str, Any]) -> Dict[str, Any]:
        """A backward that accumulates nothing: no micro-batch id, no room in the step needed."""
        peer, runner = self.peer, served(self.peer.runner, "runner")
        before, resets = runner.version, runner.resets
        with peer.compute.serving():
            grad_inputs, loss, step = await peer.compute.run(
                runner.backward, "", request.get("inputs"), request.get("grad_outputs"), request.get("targets"), False
            )
        return _backward_reply(grad_inputs, loss, step, runner, before, resets)

    async def info(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        """The peer's record, plus what its compute did: forward passes run, backward passes that recomputed
        their forward, and the forward cache's counters (what a benchmark or an operator wants to see)."""
        reply = self.peer.announcer.record().model_dump(mode="json")
        runner = self.peer.runner
        if runner is not None:
            reply["compute"] = {
                "forwards": runner.num_forwards,
                "recomputed": runner.num_recomputed,
                "forward_cache": runner.forward_cache.stats(),
            }
        return reply

    async def parameters(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        """The stage's parameters (to export a trained model, or to check replicas agree); with
        ``gradients: true`` also the mean gradient accumulated so far for the current step."""
        peer = self.peer
        return await peer.compute.run(served(peer.runner, "runner").export, bool(request.get("gradients", False)))

    async def step_members(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        """The peers whose gradients a recent applied step averaged: how a trainer learns whether a
        replica that died had its contribution included before it went."""
        peer, step = self.peer, request.get("step")
        if request.get("stage") != peer.stage:
            raise RemoteError(f"this peer serves stage {peer.stage}, not {request.get('stage')!r}", "wrong_stage")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"step must be an integer, got {type(step).__name__}")
        remembered = served(peer.steps, "step coordinator").members
        members = remembered.get(step)
        if members is None:
            raise ValueError(
                f"unknown step {step}: this replica remembers steps "
                f"{min(remembered, default='-')}..{max(remembered, default='-')}"
            )
        return {"step": step, "members": list(members)}

    async def settings(self, request: Dict[str, Any], caller: str) -> Dict[str, Any]:
        """The run settings this peer serves, so that a newcomer with other settings learns which field differs."""
        return settings_reply(self.peer.run)


def _backward_reply(
    grad_inputs: Optional[torch.Tensor],
    loss: Optional[float],
    step: int,
    runner: "StageRunner",
    before: Tuple[int, str],
    resets: int,
) -> Dict[str, Any]:
    reply: Dict[str, Any] = {"step": step, "resets": resets}
    if grad_inputs is not None:
        reply["grad_inputs"] = grad_inputs
    if loss is not None:
        reply["loss"] = loss
    _stamp(reply, "params_step", runner, before)
    return reply
