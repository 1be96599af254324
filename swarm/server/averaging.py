"""All-reduce of one stage's gradients among its replicas, and sharing of the stage's state.

A thin subclass of hivemind's ``DecentralizedAverager`` (a separate process): one averager
per stage peer, one group prefix per stage, the group key bits set to the step being
averaged so that replicas at different steps never meet in one group. State sharing hands a
joining replica the parameters, AdamW moments and step through hivemind's download RPC.

In a private run (a non-empty allowlist) the averager deals only with allowlisted peers: it refuses
join requests, tensor parts and state downloads from anyone else (hivemind's averaging RPCs have
no access control of their own), never asks an outsider to lead its group, and refuses to average
in a group that contains one.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from hivemind import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_logger

from swarm.auth import Allowlist

__all__ = ["StageAverager", "step_group_bits"]

logger = get_logger(__name__)
GROUP_BITS = 16


def step_group_bits(step: int) -> str:
    return format(step % 2**GROUP_BITS, f"0{GROUP_BITS}b")


class StageAverager(DecentralizedAverager):
    """Averages gradient-shaped tensors; serves ``state_fn()`` to replicas that download state.

    ``state_fn`` runs in the peer's main process (hivemind calls it from a helper thread there)
    and must return (metadata dict, list of tensors). ``allowlist`` (peer ids; empty = anyone)
    is checked in the averager's own process, on every incoming call and on every group.
    """

    def __init__(self, grad_shapes: Sequence[torch.Tensor], state_fn: Callable[[], Tuple[Dict[str, Any], List[torch.Tensor]]],
                 allowlist: Iterable[str] = (), **kwargs: Any):
        self._state_fn = state_fn
        self._allowlist = Allowlist.of(allowlist)
        self._refused: Set[str] = set()  # outsiders already logged, so each gets one warning
        # float64: hivemind applies the average as ``x_i + (avg - x_i)``, which rounds differently on
        # each replica; in float64 the rounding error stays far below float32 resolution, so the
        # replicas' float32 results agree (and the parameter digest catches the rare case they don't)
        super().__init__([torch.zeros_like(t, dtype=torch.float64) for t in grad_shapes], **kwargs)

    def get_current_state(self):
        metadata, tensors = self._state_fn()
        return metadata, tensors, None

    async def average(self, step: int, mean_grads: Sequence[torch.Tensor], samples: int, gather: Dict[str, Any],
                      matchmaking_timeout: float, timeout: float) -> Optional[Tuple[List[torch.Tensor], Dict[str, Any]]]:
        """One all-reduce round for ``step``: returns (averaged grads, gathered metadata by peer) or None on failure.

        ``matchmaking_timeout`` bounds the search for a group: a short one lets the caller notice
        quickly that a replica died and go on without it."""
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.set_group_bits(step_group_bits(step)))
        with self.get_tensors() as tensors:
            for dst, src in zip(tensors, mean_grads):
                dst.copy_(src.to(torch.float64))
        try:
            control = self.step(gather=gather, weight=float(max(samples, 1e-6)), timeout=matchmaking_timeout,
                                wait=False, allow_retries=False)
            gathered = await asyncio.wait_for(control, timeout=timeout + 5)
        except Exception as e:
            logger.info(f"averaging step {step} failed: {type(e).__name__}: {e}")
            return None
        if not gathered:
            return None
        with self.get_tensors() as tensors:
            averaged = [t.clone() for t in tensors]
        return averaged, {str(peer): data for peer, data in gathered.items()}

    # ---- private runs: every check below runs in the averager's process ----

    def _allowed(self, peer_id: PeerID, what: str) -> bool:
        if self._allowlist.allows(peer_id):
            return True
        if str(peer_id) not in self._refused:
            self._refused.add(str(peer_id))
            logger.warning(f"refusing {what} from {peer_id}: it is not in the run's allowlist")
        return False

    async def rpc_join_group(self, request: averaging_pb2.JoinRequest,
                             context: P2PContext) -> AsyncIterator[averaging_pb2.MessageFromLeader]:
        if not self._allowed(context.remote_id, "a request to join an averaging group"):
            yield averaging_pb2.MessageFromLeader(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_join_group(request, context):
            yield message

    async def rpc_aggregate_part(self, stream: AsyncIterator[averaging_pb2.AveragingData],
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.AveragingData]:
        if not self._allowed(context.remote_id, "tensor parts for averaging"):
            yield averaging_pb2.AveragingData(code=averaging_pb2.PROTOCOL_VIOLATION)
            return
        async for message in super().rpc_aggregate_part(stream, context):
            yield message

    async def rpc_download_state(self, request: averaging_pb2.DownloadRequest,
                                 context: P2PContext) -> AsyncIterator[averaging_pb2.DownloadData]:
        if not self._allowed(context.remote_id, "a state download"):
            return  # an empty reply: hivemind's downloader moves on to the next peer
        async for message in super().rpc_download_state(request, context):
            yield message

    async def _step(self, **kwargs: Any) -> None:
        self._follow_only_allowed_leaders()
        await super()._step(**kwargs)

    def _follow_only_allowed_leaders(self) -> None:
        """Make matchmaking skip leaders outside the allowlist: joining one would only end in a
        group this averager refuses (see ``_aggregate_with_group``)."""
        matchmaking = self._matchmaking
        if self._allowlist.is_open or getattr(matchmaking, "_swarm_guarded", False):
            return
        request_join_group = matchmaking._request_join_group

        async def request_allowed_leader(leader: PeerID) -> Optional[GroupInfo]:
            if not self._allowed(leader, "an offer to lead an averaging group"):
                return None
            return await request_join_group(leader)

        matchmaking._request_join_group = request_allowed_leader
        matchmaking._swarm_guarded = True

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any):
        outsiders = [peer for peer in group_info.peer_ids if not self._allowlist.allows(peer)]
        if outsiders:
            error = MatchmakingException(f"refusing to average with {[str(p) for p in outsiders]}: not in the allowlist")
            # groupmates' parts wait on this future: fail them now rather than at their timeout
            pending = self._running_groups.get(group_info.group_id)
            if pending is not None and not pending.done():
                pending.set_exception(error)
                pending.exception()  # retrieved here, so asyncio does not report it as never retrieved
            logger.warning(str(error))
            raise error
        return await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
