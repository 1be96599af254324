"""A trainer's spot checks of stage replies on other replicas, and its handling of accusations.

Acts on the decisions of :mod:`swarm.policy.verification` (which states the design): draws which
replies to check, calls a witness (and on a mismatch a referee) through the trainer's
:class:`~swarm.client.pipeline.PipelineClient`, bans an outvoted replica and publishes the accusation,
and turns accusations read from the DHT into suspicion. Runs in the trainer's event loop.

With lossy compression, two replies are compared as they arrived, decoded: replicas whose outputs agree
bit for bit send the same bytes, but outputs that differ by float32 noise (replicas on other kernels or
devices) can round to neighbouring codes. The policy's ``rtol`` is therefore widened by what compression
alone may add (:func:`compression_slack`), so that no honest pair is accused for it.
"""

from __future__ import annotations

import random
import time
from typing import Any, Awaitable, Callable, Dict, List, Literal, Mapping, Optional, Sequence

import torch
from hivemind.utils import get_logger

from swarm import PROTOCOL_VERSION
from swarm.client.pipeline import PipelineClient
from swarm.net.compression import FLOAT_DTYPES, CompressionError, compress, error_bound
from swarm.metrics import count_ban, count_verification
from swarm.policy.verification import (
    Observation,
    VerificationBook,
    VerificationPolicy,
    blame_incomparable,
    compare,
    compared_keys,
    fingerprint,
    outvoted,
    params_step,
    request_fingerprint,
)
from swarm.dht.records import AccusationRecord

__all__ = ["ReplyVerifier", "compression_slack"]

logger = get_logger(__name__)


def compression_slack(replies: Sequence[Mapping[str, Any]], keys: Sequence[str], codec: str, block_size: int) -> float:
    """The relative L2 distance that compressing two of ``replies`` may add to the distance of their originals.

    Each decoded tensor lies within :func:`swarm.net.compression.error_bound` of what its replica computed, so
    two decoded replies differ by at most their originals' distance plus both bounds' norms: twice the
    largest bound relative to its tensor's norm. Recompressing a decoded tensor gives that bound again
    (its blocks keep their scales). 0 without compression; pure, no I/O."""
    if codec == "none":
        return 0.0
    worst = 0.0
    for reply in replies:
        for key in keys:
            value = reply.get(key)
            if not isinstance(value, torch.Tensor) or value.dtype not in FLOAT_DTYPES:
                continue
            norm = float(value.double().norm())
            try:
                bound = float(error_bound(compress(value, codec, block_size)).double().norm())
            except CompressionError:  # NaN or inf: such a reply fails every comparison anyway
                continue
            if norm > 0:
                worst = max(worst, bound / norm)
    return 2 * worst


def _accused_method(method: str) -> Literal["forward", "backward"]:
    """``method`` as an accusation names it: only forward and backward replies are compared."""
    if method == "forward":
        return "forward"
    if method == "backward":
        return "backward"
    raise ValueError(f"no accusation is made of a {method!r} reply: only forward and backward replies are compared")


class ReplyVerifier:
    """Checks a random share of one trainer's stage replies; ``publish`` stores an accusation in the DHT
    and ``announced_steps(stage)`` gives the steps that the stage's online replicas announce."""

    def __init__(
        self,
        client: PipelineClient,
        policy: VerificationPolicy,
        own_id: str,
        *,
        announced_steps: Callable[[int], Sequence[int]],
        publish: Callable[[AccusationRecord], Awaitable[Any]],
        seed: int = 0,
    ):
        self.client, self.policy, self.own_id = client, policy, own_id
        self.book = VerificationBook(policy, own_id)
        self.announced_steps, self.publish = announced_steps, publish
        self._rng = random.Random(seed)
        self.num_checks = 0  # replies compared with another replica's
        self.num_caught = 0  # replicas outvoted and banned

    async def check(
        self, stage: int, method: str, message: Mapping[str, Any], reply: Dict[str, Any], peer_id: str, timeout: float
    ) -> Dict[str, Any]:
        """The reply to use for ``message``: ``reply``, unless a check outvoted ``peer_id`` (then the
        majority's). A check that cannot be made (no other replica, a failed call) changes nothing."""
        keys = compared_keys(method, stage, self.client.num_stages)
        if not keys or not self.book.should_verify(peer_id, time.monotonic(), self._rng.random()):
            return reply
        try:
            return await self._check(
                stage, method, message, Observation(peer_id, params_step(method, reply), reply), keys, timeout
            )
        except Exception:  # a bug here must not cost the micro-batch: the reply passed every other check
            logger.exception(f"checking the stage {stage} {method} reply of {peer_id} failed")
            return reply

    async def _check(
        self,
        stage: int,
        method: str,
        message: Mapping[str, Any],
        first: Observation,
        keys: Sequence[str],
        timeout: float,
    ) -> Dict[str, Any]:
        # a backward marked 'verify' computes the same reply without adding to the replica's gradients
        # a forward checked elsewhere carries no micro-batch id: that replica has no backward to keep its graph for
        request = (
            {k: v for k, v in message.items() if k != "micro_batch_id"}
            if method == "forward"
            else {**message, "verify": True}
        )
        second = await self._observe(stage, method, request, timeout, exclude=[first.peer_id])
        if second is None:
            return dict(first.reply)
        self.num_checks += 1
        verdict = compare(first, second, keys, self._rtol([first, second], keys))
        count_verification(verdict.comparison)
        if verdict.comparison == "agree":
            self.book.agreed([first.peer_id, second.peer_id])
        elif verdict.comparison == "incomparable":
            self._blame(stage, [first, second], verdict.reason)
        else:
            return await self._decide(stage, method, message, request, [first, second], keys, timeout, verdict.reason)
        return dict(first.reply)

    async def _decide(
        self,
        stage: int,
        method: str,
        message: Mapping[str, Any],
        request: Dict[str, Any],
        pair: List[Observation],
        keys: Sequence[str],
        timeout: float,
        reason: str,
    ) -> Dict[str, Any]:
        """Two replies disagree: a third replica decides which one is outvoted."""
        first, second = pair
        third = await self._observe(stage, method, request, timeout, exclude=[first.peer_id, second.peer_id])
        trio = [first, second] if third is None else [first, second, third]
        loser = None if third is None else outvoted(trio, keys, self._rtol(trio, keys))
        now = time.monotonic()
        if loser is None:
            logger.warning(
                f"stage {stage} {method} replies of {first.peer_id} and {second.peer_id} disagree "
                f"({reason}) and no third replica settled it; suspecting both"
            )
            self.book.suspect(first.peer_id, now)
            self.book.suspect(second.peer_id, now)
            return dict(first.reply)
        winners = [o for o in trio if o is not loser]
        self.book.agreed([o.peer_id for o in winners])
        await self._convict(stage, method, message, loser, winners, keys, reason)
        return dict(winners[0].reply)

    def _rtol(self, observations: Sequence[Observation], keys: Sequence[str]) -> float:
        """The policy's tolerance, widened by what the run's compression may add between these replies."""
        replies = [o.reply for o in observations]
        return self.policy.rtol + compression_slack(replies, keys, self.client.compression, self.client.block_size)

    async def _observe(
        self, stage: int, method: str, request: Dict[str, Any], timeout: float, exclude: Sequence[str]
    ) -> Optional[Observation]:
        peer_id = self.client.choose_replica(stage, exclude)
        if peer_id is None:
            return None
        reply = await self.client.call_replica(peer_id, stage, method, request, timeout)
        return None if reply is None else Observation(peer_id, params_step(method, reply), reply)

    def _blame(self, stage: int, pair: List[Observation], reason: str) -> None:
        """Replies that could not be compared: a strike for the replica whose step is off, if one is."""
        for index in blame_incomparable([o.step for o in pair], self.announced_steps(stage), self.policy.max_step_lag):
            peer_id = pair[index].peer_id
            if self.book.strike(peer_id):
                self.client.router.distrust(peer_id, time.monotonic(), self.policy.ban_s)
                count_ban("trainer", "incomparable")
                logger.warning(
                    f"banning peer {peer_id} of stage {stage}: {self.policy.max_strikes} checks in a row "
                    f"could not compare its replies with other replicas' ({reason})"
                )

    async def _convict(
        self,
        stage: int,
        method: str,
        message: Mapping[str, Any],
        loser: Observation,
        winners: List[Observation],
        keys: Sequence[str],
        reason: str,
    ) -> None:
        """Ban the outvoted replica, settle accusations of it, and publish this trainer's own."""
        self.num_caught += 1
        self.client.router.distrust(loser.peer_id, time.monotonic(), self.policy.ban_s)
        count_ban("trainer", "outvoted")
        logger.warning(
            f"banning peer {loser.peer_id} of stage {stage}: its {method} reply was outvoted by "
            f"{winners[0].peer_id} and {winners[1].peer_id} ({reason})"
        )
        confirmed = self.book.caught(loser.peer_id)
        if confirmed:
            logger.info(f"this confirms the accusations of {loser.peer_id} by {', '.join(confirmed)}")
        if loser.step is None:  # outvoted() compares only replies whose step is known
            raise ValueError(f"the outvoted {method} reply of {loser.peer_id} names no step: nothing to accuse it of")
        record = AccusationRecord(
            version=PROTOCOL_VERSION,
            trainer_id=self.own_id,
            accused=loser.peer_id,
            witness=winners[0].peer_id,
            referee=winners[1].peer_id,
            stage=stage,
            method=_accused_method(method),
            step=loser.step,
            inputs_hash=request_fingerprint(message),
            accused_hash=fingerprint(loser.reply, keys),
            witness_hash=fingerprint(winners[0].reply, keys),
        )
        await self.publish(record)

    def consider(self, accusations: Mapping[str, AccusationRecord], now: float) -> None:
        """Accusations read from the DHT (keyed by author): suspect the accused of credible ones; then
        close the accusations whose suspicion is over, refuting those this trainer's checks did not bear out."""
        for author, record in accusations.items():
            evidence = (record.method, record.step, record.inputs_hash, record.accused_hash)
            verdict = self.book.consider(author, record.accused, record.stage, evidence, now)
            if verdict.action == "suspect":
                logger.info(
                    f"suspecting peer {record.accused} of stage {record.stage} for "
                    f"{self.policy.suspicion_s:.0f} s: {verdict.reason} (its {record.method} reply at step "
                    f"{record.step} was outvoted by {record.witness} and {record.referee})"
                )
            elif verdict.reason.startswith("its author"):
                logger.info(f"ignoring the accusation of {record.accused} by {author}: {verdict.reason}")
        for author, accused, refuted in self.book.expire(now):
            if refuted:
                logger.warning(
                    f"{self.policy.min_checks} checks of {accused} found no mismatch: the accusation by "
                    f"{author} was not borne out, and counts against its author"
                )
