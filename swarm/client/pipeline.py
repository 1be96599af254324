"""Sends one micro-batch through every stage of the swarm: forward, then backward in reverse.

The trainer relays activations between stages (as in SWARM): it sends stage k's output to a
replica of stage k+1 chosen by throughput-weighted stochastic wiring, and keeps each stage's
input so that any replica can run that stage's backward (stateless, with recomputation).
Each call has a timeout; a failed or slow replica is banned with backoff and the call is
retried on another replica of the same stage, a bounded number of times.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_logger

from swarm.client.ledger import Contribution, Ledger
from swarm.policy.routing import NoPeerAvailable, Router
from swarm.policy.snapshot import PeerInfo
from swarm.rpc import RemoteError, call_peer

__all__ = ["PipelineClient", "StageUnavailable"]

logger = get_logger(__name__)


class StageUnavailable(RuntimeError):
    """No replica of a stage completed a call within the allowed retries."""


class PipelineClient:
    """Routes calls to stage replicas; ``snapshot()`` returns the current peers (refreshed elsewhere)."""

    def __init__(self, p2p: P2P, num_stages: int, snapshot: Callable[[], Sequence[PeerInfo]], router: Router,
                 ledger: Ledger, *, forward_timeout_s: float, backward_timeout_s: float, max_retries: int,
                 on_stale_snapshot: Optional[Callable[[], None]] = None):
        self.p2p, self.num_stages, self.snapshot, self.router, self.ledger = p2p, num_stages, snapshot, router, ledger
        self.forward_timeout_s, self.backward_timeout_s, self.max_retries = forward_timeout_s, backward_timeout_s, max_retries
        self.on_stale_snapshot = on_stale_snapshot or (lambda: None)
        self.num_failed_calls = 0

    async def call_stage(self, stage: int, method: str, message: Dict[str, Any], timeout: float) -> Tuple[Dict[str, Any], str]:
        """Call ``method`` on some replica of ``stage``; returns (reply, peer id)."""
        tried: List[str] = []
        last_error = "no attempt made"
        for attempt in range(self.max_retries):
            candidates = [p for p in self.snapshot() if p.stage == stage]
            exclude = tried if len(set(tried)) < len(candidates) else ()
            try:
                peer = self.router.choose(candidates, time.monotonic(), exclude=exclude)
            except NoPeerAvailable as e:
                last_error = str(e)
                self.on_stale_snapshot()
                await asyncio.sleep(min(0.5 * 2**attempt, 5.0))
                continue
            try:
                reply = await call_peer(self.p2p, PeerID.from_base58(peer.peer_id), method, {**message, "stage": stage},
                                        timeout=timeout)
                self.router.report_success(peer.peer_id)
                return reply, peer.peer_id
            except RemoteError as e:
                if e.kind == "bad_request":
                    raise
                last_error = f"{peer.peer_id}: {e}"
                if e.kind == "wrong_stage":
                    self.on_stale_snapshot()
            except Exception as e:  # timeouts, dead peers, broken streams
                last_error = f"{peer.peer_id}: {type(e).__name__}: {e}"
            self.num_failed_calls += 1
            self.router.ban(peer.peer_id, time.monotonic())
            tried.append(peer.peer_id)
            logger.debug(f"stage {stage} {method} attempt {attempt + 1} failed: {last_error}")
        raise StageUnavailable(f"stage {stage}: {method} failed after {self.max_retries} attempts; last error: {last_error}")

    async def evaluate(self, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward only, through all stages; the last stage returns the loss."""
        x = inputs
        for stage in range(self.num_stages - 1):
            reply, _ = await self.call_stage(stage, "forward", {"inputs": x}, self.forward_timeout_s)
            x = reply["outputs"]
        reply, _ = await self.call_stage(self.num_stages - 1, "forward", {"inputs": x, "targets": targets},
                                         self.forward_timeout_s)
        return float(reply["loss"])

    async def train_step(self, micro_batch_id: str, inputs: torch.Tensor, targets: torch.Tensor) -> float:
        """Forward and backward of one micro-batch; every stage's contribution goes into the ledger."""
        stage_inputs = [inputs]
        for stage in range(self.num_stages - 1):
            reply, _ = await self.call_stage(stage, "forward", {"inputs": stage_inputs[-1]}, self.forward_timeout_s)
            stage_inputs.append(_tensor(reply, "outputs", stage))
        last = self.num_stages - 1
        item = Contribution(micro_batch_id, last, "", 0, int(inputs.shape[0]), stage_inputs[last], None, targets)
        reply = await self.backward(item)
        loss = float(reply["loss"])
        grad = reply.get("grad_inputs")
        for stage in reversed(range(last)):
            item = Contribution(micro_batch_id, stage, "", 0, int(inputs.shape[0]), stage_inputs[stage], grad, None)
            grad = (await self._backward_persistently(item)).get("grad_inputs")
        return loss

    async def _backward_persistently(self, item: Contribution, rounds: int = 3) -> Dict[str, Any]:
        """Backward of a stage below the last: the stages above already counted this micro-batch,
        so giving up would leave them with samples this stage never saw. Retry a few rounds (a
        stage can be briefly without replicas while a peer moves) before failing the micro-batch."""
        for attempt in range(rounds - 1):
            try:
                return await self.backward(item)
            except (StageUnavailable, RemoteError) as e:
                # our own, well-formed request: a 'bad_request' here means a mangled transfer
                logger.warning(f"backward of {item.micro_batch_id} at stage {item.stage} failed, retrying: {e}")
                await asyncio.sleep(min(2.0 * 2**attempt, 10.0))
        return await self.backward(item)

    async def backward(self, item: Contribution, resend: bool = False) -> Dict[str, Any]:
        """Run (or re-run) one stage's backward for a contribution and record where it landed."""
        message: Dict[str, Any] = {"micro_batch_id": item.micro_batch_id, "inputs": item.inputs}
        if item.grad_outputs is not None:
            message["grad_outputs"] = item.grad_outputs
        if item.targets is not None:
            message["targets"] = item.targets
        reply, peer_id = await self.call_stage(item.stage, "backward", message, self.backward_timeout_s)
        step = reply.get("step")
        if not isinstance(step, int) or step < 0:
            raise RemoteError(f"stage {item.stage} replied to backward without a valid step", "internal")
        if item.stage > 0:
            _tensor(reply, "grad_inputs", item.stage)
        if resend:
            self.ledger.resent(item, peer_id, step)
        else:
            item.peer_id, item.step = peer_id, step
            self.ledger.add(item)
        return reply


def _tensor(reply: Dict[str, Any], key: str, stage: int) -> torch.Tensor:
    value = reply.get(key)
    if not isinstance(value, torch.Tensor):
        raise RemoteError(f"stage {stage} replied without {key}", "internal")
    if value.is_floating_point() and not bool(torch.isfinite(value).all()):
        raise RemoteError(f"stage {stage} replied with non-finite {key}", "internal")
    return value
