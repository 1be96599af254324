"""All-reduce of one stage's gradients among its replicas, and sharing of the stage's state.

A thin subclass of hivemind's ``DecentralizedAverager`` (a separate process): one averager
per stage peer, one group prefix per stage, the group key bits set to the step being
averaged so that replicas at different steps never meet in one group. State sharing hands a
joining replica the parameters, AdamW moments and step through hivemind's download RPC, streamed in and out
without a second copy of the state (see :mod:`.state_sharing`).

With ``aggregation`` set (the run's defences on), a group's round is :class:`RobustRound`: every member
holds every groupmate's whole signed gradient and combines them with CenteredClip itself, so no member
reduces a part for the others; members caught sending non-finite, far-off or two different gradients are
banned by this averager for ``ban_s`` seconds (their later join requests and parts are refused). Without
it, hivemind's butterfly all-reduce computes the weighted mean.

With the run's ``compression``, a robust round sends every gradient compressed (see
:mod:`.robust_allreduce`); the butterfly sends its parts and their averages through hivemind's
``Float16Compression`` (fp16) or :class:`BlockwiseInt8` (int8, our quantizer). hivemind's receiver picks
the decoder by the codec's protobuf tag, so :class:`BlockwiseInt8` takes the ``BLOCKWISE_8BIT`` tag in
the averager's process (hivemind's own codec of that tag needs bitsandbytes, which we do not use).
The butterfly returns each member its average as a compressed difference from that member's own
part, so members end apart by the compression's error: their parameter digests differ after the step
and one of them downloads the other's state (see :mod:`swarm.policy.steps`). A robust round has no
such drift: every member aggregates the same decoded gradients.

In a private run (a non-empty allowlist) the averager deals only with allowlisted peers: it refuses
join requests, tensor parts and state downloads from anyone else (hivemind's averaging RPCs have
no access control of their own), never asks an outsider to lead its group, and refuses to average
in a group that contains one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import time
from functools import partial
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import CompressionBase, CompressionInfo, Float16Compression
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture, get_dht_time, get_logger
from hivemind.utils.crypto import RSAPrivateKey

from swarm.dht.auth import Allowlist
from swarm.dht.node import store_in_dht
from swarm.hivemind_private import register_decoder, wrap_join_request
from swarm.net.compression import (
    DEFAULT_BLOCK_SIZE,
    Compressed,
    CompressionError,
    check_block_size,
    compress,
    decompress,
)
from swarm.net.ternary import check_gradient_codec
from swarm.policy.aggregation import Aggregate, AggregationConfig
from swarm.policy.alignment import AlignmentRecord
from swarm.server.robust_allreduce import IncompleteRound, RobustRound
from swarm.server.state_sharing import StateSharingAverager

__all__ = [
    "StageAverager",
    "RoundResult",
    "RoundGivenUp",
    "await_round",
    "BlockwiseInt8",
    "butterfly_compression",
    "check_group_sizes",
    "step_group_bits",
    "ReportedRoundFailures",
]

logger = get_logger(__name__)
GROUP_BITS = 16
OUTCOME_KEY = "swarm.robust_outcome"  # where a robust round's outcome travels back with the gathered metadata


class RoundResult:
    """What one averaging round gave: the combined gradient, the groupmates' gathered metadata, and (for a
    robust round) who went in, who was left out and why, who got banned, and the bytes of messages the averager
    sent and received in all its robust rounds so far (``wire_bytes``)."""

    def __init__(self, tensors: List[torch.Tensor], gathered: Dict[str, Any], outcome: Optional[Dict[str, Any]]):
        self.tensors, self.gathered = tensors, gathered
        self.included: List[str] = list(outcome["included"]) if outcome else sorted(gathered)
        self.weights: Dict[str, float] = dict(outcome["weights"]) if outcome else {}
        self.excluded: Dict[str, str] = dict(outcome["excluded"]) if outcome else {}
        self.banned: Dict[str, str] = dict(outcome["banned"]) if outcome else {}
        self.tau: float = float(outcome["tau"]) if outcome else 0.0
        self.wire_bytes: int = int(outcome.get("wire_bytes", 0)) if outcome else 0  # the averager's total so far


def check_group_sizes(min_group_size: int, full_group_size: Optional[int]) -> None:
    """Raise ValueError unless a round may average with ``min_group_size`` members and start at ``full_group_size``."""
    if min_group_size < 2:
        raise ValueError(f"an averaging group needs at least 2 members, got min_group_size={min_group_size}")
    if full_group_size is not None and full_group_size < min_group_size:
        raise ValueError(f"full_group_size ({full_group_size}) is below min_group_size ({min_group_size})")


def step_group_bits(step: int) -> str:
    return format(step % 2**GROUP_BITS, f"0{GROUP_BITS}b")


class BlockwiseInt8(CompressionBase):
    """hivemind's codec interface over :func:`swarm.net.compression.compress` with ``int8``: one code per value
    and one float32 scale per ``block_size`` values of each part. The protobuf carries the codes then the
    scales; the part's dtype (float32 or float64) comes back on extraction. Everything a sender wrote is
    checked (lengths, codes, finite scales and values) before a value is used."""

    compression_type = runtime_pb2.CompressionType.BLOCKWISE_8BIT
    DTYPES = {"float32": torch.float32, "float64": torch.float64}

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE):
        self.block_size = check_block_size(block_size)

    def compress(self, tensor: torch.Tensor, info: CompressionInfo, allow_inplace: bool = False) -> runtime_pb2.Tensor:
        dtype = str(tensor.dtype).replace("torch.", "")
        if dtype not in self.DTYPES:
            raise CompressionError(f"{type(self).__name__} sends float32 and float64 tensors, not {tensor.dtype}")
        c = compress(tensor.detach().cpu().to(torch.float32), "int8", self.block_size)
        return runtime_pb2.Tensor(
            compression=self.compression_type,
            buffer=c.data + c.scales,
            size=tensor.shape,
            dtype=dtype,
            requires_grad=False,
        )

    def extract(self, serialized_tensor: runtime_pb2.Tensor) -> torch.Tensor:
        dtype = self.DTYPES.get(serialized_tensor.dtype)
        if dtype is None:
            raise CompressionError(f"int8 part of dtype {serialized_tensor.dtype[:32]!r}")
        shape = tuple(serialized_tensor.size)
        numel = math.prod(shape)
        buffer = serialized_tensor.buffer
        c = Compressed("int8", shape, self.block_size, buffer[:numel], buffer[numel:])
        return decompress(c).to(dtype)

    def estimate_compression_ratio(self, info: CompressionInfo) -> float:
        bits = torch.finfo(info.descriptor.dtype).bits if info.descriptor.dtype.is_floating_point else 32
        return (8 + 32 / self.block_size) / bits


class RoundGivenUp(Exception):
    """The caller called off an averaging round before it found a group."""


async def await_round(control: MPFuture, timeout: float, give_up: Optional[Callable[[], Awaitable[Any]]]) -> Any:
    """What the averaging round ``control`` gathered; raises :class:`RoundGivenUp` if the awaitable that
    ``give_up`` makes completes first while the round is still looking for a group."""
    round_ = asyncio.ensure_future(asyncio.wait_for(control, timeout=timeout))
    if give_up is None:
        return await round_
    quit_ = asyncio.ensure_future(give_up())
    try:
        await asyncio.wait({round_, quit_}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        round_.cancel()
        raise
    finally:
        quit_.cancel()
    if round_.done() or control.began_allreduce or quit_.cancelled() or quit_.exception() is not None:
        return await round_
    control.cancel()  # hivemind's averager stops looking for a group when its step is cancelled
    round_.cancel()
    await asyncio.gather(round_, return_exceptions=True)
    raise RoundGivenUp("called off while looking for a group")


def butterfly_compression(codec: str, block_size: int = DEFAULT_BLOCK_SIZE) -> CompressionBase:
    """What hivemind's butterfly all-reduce sends parts in, for the run's ``codec``."""
    if codec == "fp16":
        return Float16Compression()
    if codec == "int8":
        return BlockwiseInt8(block_size)
    raise ValueError(f"the butterfly all-reduce compresses in fp16 or int8, not {codec!r}")


def _register_decoder(codec: CompressionBase) -> None:
    """Make hivemind decode ``codec``'s tag with ``codec`` in this process: its receiver looks decoders up
    by tag, in one table of its own."""
    register_decoder(runtime_pb2.CompressionType.Name(codec.compression_type), codec)


class ReportedRoundFailures(logging.Filter):
    """Drops hivemind's ERROR line with a traceback for an averaging round that found no group or failed
    in matchmaking or in the all-reduce. Such a round ends in an exception that :meth:`StageAverager.average`
    receives and reports on one line; it is an expected event (a groupmate died or left, replicas stepped
    apart), not a fault of this peer, and a traceback per round would bury a peer's log. Anything else
    hivemind logs passes."""

    LOGGER = "hivemind.averaging.averager"

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not isinstance(error, (AllreduceException, MatchmakingException))

    @classmethod
    def install(cls) -> None:
        target = logging.getLogger(cls.LOGGER)
        if not any(isinstance(f, cls) for f in target.filters):
            target.addFilter(cls())


def averaged_buffers(templates: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """The averager's own tensors, one per template: float64 zeros in host memory, whatever the templates'
    device. The averager's process is forked from the peer's and shares these tensors with it: a forked
    process cannot use CUDA, so tensors on a GPU would leave every round without a group.

    float64: hivemind applies the average as ``x_i + (avg - x_i)``, which rounds differently on each
    replica; in float64 the rounding error stays far below float32 resolution, so the replicas' float32
    results agree (and the parameter digest catches the rare case they don't)."""
    return [torch.zeros(tuple(t.shape), dtype=torch.float64, device="cpu") for t in templates]


class StageAverager(StateSharingAverager):
    """Averages gradient-shaped tensors; serves ``state_fn()`` to replicas that download state.

    ``state_fn`` runs in the peer's main process (hivemind calls it from a helper thread there)
    and must return (metadata dict, list of tensors). ``allowlist`` (peer ids; empty = anyone)
    is checked in the averager's own process, on every incoming call and on every group. Subclasses (emulated
    faulty replicas) serve and call its RPCs under its name.
    """

    RPC_NAME = "StageAverager"

    def __init__(
        self,
        grad_shapes: Sequence[torch.Tensor],
        state_fn: Callable[[], Tuple[Dict[str, Any], List[torch.Tensor]]],
        allowlist: Iterable[str] = (),
        aggregation: Optional[AggregationConfig] = None,
        signing_key: Optional[RSAPrivateKey] = None,
        ban_s: float = 3600.0,
        max_samples: Optional[float] = None,
        compression: str = "none",
        block_size: int = DEFAULT_BLOCK_SIZE,
        **kwargs: Any,
    ):
        self._state_fn = state_fn
        if check_gradient_codec(compression) == "ternary" and aggregation is None:
            raise ValueError(
                "ternary gradients need the robust all-reduce (defences on): hivemind's butterfly all-reduce sums "
                "parts of gradients, and a sum of ternary parts is no longer ternary"
            )
        self._compression, self._block_size = compression, check_block_size(block_size)
        if aggregation is None and compression != "none":
            kwargs["compression"] = butterfly_compression(compression, block_size)
        self._allowlist = Allowlist.of(allowlist)
        self._refused: Set[str] = set()  # outsiders already logged, so each gets one warning
        if aggregation is not None and signing_key is None:
            raise ValueError("robust aggregation signs every contribution: it needs the peer's signing_key")
        self._aggregation, self._signing_key = aggregation, signing_key
        self._ban_s, self._max_samples = ban_s, max_samples
        self._banned: Dict[str, float] = {}  # peer id -> time.monotonic() until which it is banned (averager process)
        self._outcomes: Dict[bytes, Aggregate] = {}
        # cosines between groupmates' gradients, round after round (averager process)
        self._alignment = AlignmentRecord(aggregation.alignment) if aggregation is not None else None
        self._wire_bytes = 0  # encoded messages sent and received in robust rounds (counted in the averager's process)
        super().__init__(averaged_buffers(grad_shapes), **kwargs)

    def run_in_background(self, await_ready: bool = True, timeout: Optional[float] = None) -> None:
        """Start the averager's process, which ignores SIGINT (a Ctrl-C reaches every process of the terminal:
        the peer, not its averager, decides how to stop). hivemind sets SIGINT to ignored in *this* process
        to fork the child so; the peer's own SIGINT handling (a graceful leave) is restored right after."""
        previous = signal.getsignal(signal.SIGINT)
        try:
            super().run_in_background(await_ready, timeout)
        finally:
            signal.signal(signal.SIGINT, previous if previous is not None else signal.SIG_DFL)

    def run(self) -> None:
        """The averager's process: decodes int8 parts with :class:`BlockwiseInt8` before serving anything,
        and leaves the report of a failed round to :meth:`average` (see :class:`ReportedRoundFailures`)."""
        ReportedRoundFailures.install()
        compression = self.allreduce_kwargs.get("compression")
        if isinstance(compression, BlockwiseInt8):
            _register_decoder(compression)
        super().run()

    def get_current_state(self):
        metadata, tensors = self._state_fn()
        return metadata, tensors, None

    async def average(
        self,
        step: int,
        mean_grads: Sequence[torch.Tensor],
        samples: int,
        gather: Dict[str, Any],
        matchmaking_timeout: float,
        timeout: float,
        min_group_size: int = 2,
        full_group_size: Optional[int] = None,
        give_up: Optional[Callable[[], Awaitable[Any]]] = None,
    ) -> Optional[RoundResult]:
        """One averaging round for ``step``: the combined gradients and who contributed, or None on failure.

        ``matchmaking_timeout`` bounds the search for a group: a short one lets the caller notice
        quickly that a replica died and go on without it. A group smaller than ``min_group_size`` is
        disbanded instead of averaged. ``give_up``: once the awaitable it makes completes, a search for a
        group that has not found one yet is called off (a group already averaging is waited for: its members
        need our part). A group that reaches ``full_group_size`` members (everyone expected) averages at once,
        without waiting out the matchmaking time; None waits it out whatever the group's size."""
        check_group_sizes(min_group_size, full_group_size)
        self.call_in_background(
            "_set_group_sizes",
            minimum=int(min_group_size),
            full=None if full_group_size is None else int(full_group_size),
        )
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.set_group_bits(step_group_bits(step)))
        mean_grads, claimed = self.contribution(list(mean_grads), samples)
        with self.get_tensors() as tensors:
            for dst, src in zip(tensors, mean_grads):
                dst.copy_(src.to(torch.float64))
        try:
            weight = max(claimed, 1e-6)
            control = self.step(
                gather=gather, weight=weight, timeout=matchmaking_timeout, wait=False, allow_retries=False
            )
            gathered = await await_round(control, timeout + 5, give_up)
        except Exception as e:
            logger.info(f"averaging step {step} failed: {type(e).__name__}: {e}")
            return None
        if not gathered:
            return None
        gathered = dict(gathered)
        outcome = gathered.pop(OUTCOME_KEY, None)
        with self.get_tensors() as tensors:
            averaged = [t.clone() for t in tensors]
        return RoundResult(averaged, {str(peer): data for peer, data in gathered.items()}, outcome)

    def contribution(self, mean_grads: List[torch.Tensor], samples: int) -> Tuple[List[torch.Tensor], float]:
        """What this replica puts into a round: its mean gradient and the samples it weighs (its own)."""
        return mean_grads, float(samples)

    def send_override(self) -> Optional[Callable[[int, torch.Tensor], torch.Tensor]]:
        """In a robust round, the vector sent to the ``index``-th other member instead of this replica's own;
        None sends everyone the same."""
        return None

    # ---- who may take part (the allowlist of a private run, bans): checked in the averager's process ----

    def ban(self, peer_ids: Iterable[str], duration_s: float) -> None:
        """Ban peers from this averager's groups for ``duration_s`` (e.g. those most of the stage banned)."""
        self.call_in_background("_ban", peer_ids=[str(p) for p in peer_ids], duration_s=float(duration_s))

    async def _ban(self, peer_ids: List[str], duration_s: float) -> None:
        until = time.monotonic() + duration_s
        for peer_id in peer_ids:
            self._banned[peer_id] = max(self._banned.get(peer_id, until), until)

    def _is_banned(self, peer_id: PeerID) -> bool:
        until = self._banned.get(str(peer_id))
        return until is not None and until > time.monotonic()

    def _allowed(self, peer_id: PeerID, what: str) -> bool:
        if self._is_banned(peer_id):
            return False
        if self._allowlist.allows(peer_id):
            return True
        if str(peer_id) not in self._refused:
            self._refused.add(str(peer_id))
            logger.warning(f"refusing {what} from {peer_id}: it is not in the run's allowlist")
        return False

    async def rpc_join_group(
        self, request: averaging_pb2.JoinRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self._allowed(context.remote_id, "a request to join an averaging group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not self._allowed(context.remote_id, "tensor parts for averaging"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not self._allowed(context.remote_id, "a state download"):
            return  # an empty reply: hivemind's downloader moves on to the next peer
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _shutdown(self, timeout: Optional[float]) -> None:
        """hivemind's shutdown, except that a p2pd that already exited is not an error: Ctrl-C in a terminal
        signals the whole process group, so p2pd may be gone before the handlers are removed from it (they went
        with it); the running groups are still finalized."""
        try:
            await super()._shutdown(timeout)
        except (OSError, ConnectionError) as e:
            logger.debug(f"p2pd was gone when the averager shut down: {type(e).__name__}: {e}")
            remaining = set()
            for group in self.running_groups.values():
                remaining.update(group.finalize(cancel=True))
            await asyncio.wait_for(asyncio.gather(*remaining), timeout)

    async def _declare_for_download_periodically(self) -> None:
        """Declare this replica in the key that hivemind's state downloader reads: every ``declare_state_period``,
        and at once when sharing is switched on or off (``_state_updated``).

        Each declaration is awaited, bounded by the period, and a failed one is logged at DEBUG: the next one
        follows within a period. (hivemind's own loop leaves each store in a task nobody awaits, so every store
        that times out on a busy DHT ends in an asyncio 'Task exception was never retrieved' traceback, hundreds
        a minute on a loaded machine.) With robust aggregation nobody reads the key: a joining replica of such
        a run picks its source from the stage's signed records, so this replica does not declare at all."""
        if self._aggregation is not None:
            return
        key = f"{self.matchmaking.group_key_manager.prefix}.all_averagers"
        declared = False
        while True:
            self.state_updated.clear()
            expiration = get_dht_time() + self.declare_state_period
            if self.allow_state_sharing or declared:  # withdraw a declaration once sharing is switched off
                declared = self.allow_state_sharing
                await self._declare_once(key, self.state_sharing_priority if declared else None, expiration)
            try:
                await asyncio.wait_for(self.state_updated.wait(), max(0.0, expiration - get_dht_time()))
            except asyncio.TimeoutError:
                pass

    async def _declare_once(self, key: str, value: Optional[float], expiration: float) -> None:
        try:
            timeout = max(0.0, expiration - get_dht_time())
            store = partial(
                store_in_dht,
                key=key,
                subkey=self.peer_id.to_bytes(),
                value=value,
                expiration_time=expiration,
                timeout=timeout,
            )
            await asyncio.wait_for(self.dht.run_coroutine(store, return_future=True), timeout)
        except (asyncio.TimeoutError, Exception) as e:
            logger.debug(f"declaring this replica's state for download failed: {type(e).__name__}: {e}")

    async def _set_group_sizes(self, minimum: int, full: Optional[int]) -> None:
        # read by matchmaking: the minimum when its time for a round is up, the full size whenever a follower joins
        self.set_group_sizes(minimum, full)

    async def _step(self, **kwargs: Any) -> None:
        self._follow_only_allowed_leaders()
        await super()._step(**kwargs)

    def _follow_only_allowed_leaders(self) -> None:
        """Make matchmaking skip leaders outside the allowlist or banned: joining one would only end in a
        group this averager refuses (see ``_aggregate_with_group``) or whose leader it does not trust."""

        def allowed_leaders_only(request_join_group: Callable) -> Callable:
            async def request_allowed_leader(leader: PeerID) -> Optional[GroupInfo]:
                if not self._allowed(leader, "an offer to lead an averaging group"):
                    return None
                return await request_join_group(leader)

            return request_allowed_leader

        wrap_join_request(self.matchmaking, allowed_leaders_only)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any):
        outsiders = [peer for peer in group_info.peer_ids if not self._allowlist.allows(peer)]
        if outsiders:
            error = MatchmakingException(
                f"refusing to average with {[str(p) for p in outsiders]}: not in the allowlist"
            )
            # groupmates' parts wait on this future: fail them now rather than at their timeout
            pending = self.running_groups.get(group_info.group_id)
            if pending is not None and not pending.done():
                pending.set_exception(error)
                pending.exception()  # retrieved here, so asyncio does not report it as never retrieved
            logger.warning(str(error))
            raise error
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        outcome = self._outcomes.pop(group_info.group_id, None)
        if outcome is None and self._aggregation is not None:
            raise MatchmakingException("this member sat the robust round out")
        if outcome is not None:
            gathered = dict(gathered)
            gathered[OUTCOME_KEY] = {
                "included": outcome.included,
                "weights": outcome.weights,
                "excluded": outcome.excluded,
                "banned": outcome.banned,
                "tau": outcome.tau,
                "wire_bytes": self._wire_bytes,
            }
        return gathered

    # ---- robust rounds: every check below runs in the averager's process ----

    def _accuse_opposed(self, outcome: Aggregate) -> None:
        """Add this round's cosines to the record, and ban the groupmates whose gradients have pointed against
        most of the others' (their contribution to this round stays in, bounded by CenteredClip)."""
        if self._alignment is None:
            return
        self._alignment.add(outcome.cosines)
        accused = {p: why for p, why in self._alignment.opposed().items() if p != str(self.peer_id)}
        for peer, why in accused.items():
            outcome.banned.setdefault(peer, why)
        self._alignment.forget(accused)

    def _count_wire_bytes(self, size: int) -> None:
        self._wire_bytes += size

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: Optional[bytes] = None, **kwargs: Any
    ) -> None:
        if self._aggregation is None:
            return await super()._run_allreduce_inplace_(tensors, group_info, group_id, **kwargs)
        group_id = group_info.group_id if group_id is None else group_id
        now = time.monotonic()
        self._banned = {peer: until for peer, until in self._banned.items() if until > now}
        vector = torch.cat([t.reshape(-1) for t in tensors]).to(torch.float32)
        samples = float(kwargs.get("weight") or 0.0)
        round_ = RobustRound(
            stub_for=lambda peer: self.get_stub(self.background_p2p, peer, namespace=self.prefix),
            group_id=group_id,
            peer_ids=group_info.peer_ids,
            peer_id=self.peer_id,
            vector=vector,
            samples=samples,
            key=self._signing_key,
            config=self._aggregation,
            banned=set(self._banned),
            timeout=0.8 * (self.allreduce_timeout or 30.0),
            chunk_timeout=float(kwargs.get("sender_timeout") or 10.0),
            max_samples=self._max_samples,
            send_override=self.send_override(),
            compression=self._compression,
            block_size=self._block_size,
            on_bytes=self._count_wire_bytes,
        )
        self.running_groups[group_id].set_result(round_)
        try:
            outcome = await round_.run()
        except IncompleteRound as e:
            logger.info(f"sitting this averaging round out: {e}")
            return  # no outcome recorded: _aggregate_with_group fails the round, and the tensors stay as they were
        self._accuse_opposed(outcome)
        for peer in outcome.banned:
            self._banned[peer] = time.monotonic() + self._ban_s
        if outcome.vector is None:
            raise MatchmakingException("robust averaging had no usable contribution")
        offset = 0
        for tensor in tensors:
            tensor.copy_(outcome.vector[offset : offset + tensor.numel()].view_as(tensor))
            offset += tensor.numel()
        self._outcomes[group_id] = outcome
