"""A ``DecentralizedAverager`` that serves and downloads a stage's state without holding it twice.

A joining replica gets the stage's parameters, AdamW moments and step through hivemind's download RPC (the wire
format of ``rpc_download_state``), but neither side goes through hivemind's own code for it, which serialises
every served tensor whole and keeps every received one in memory, several times over, before pickling the lot
from the averager's process to the peer's:

- serving, each tensor is cut into parts straight from its memory (:func:`.state_transfer.stream_state`);
- downloading, the averager's process writes every part at its place in an unnamed temporary file created by the
  peer's process, which then maps it: the tensors the caller gets are views of that file
  (:mod:`.state_transfer`). Only the file's descriptor and where each tensor lies cross the process pipe.

Peak memory of a download is about one copy of the state (the file's pages, which the kernel may write back and
drop) plus a part; a state let go is gone before the next download begins.
"""

from __future__ import annotations

import asyncio
import random
from concurrent.futures import InvalidStateError
from typing import Any, AsyncIterator, Awaitable, Callable, List, Literal, Optional, Sequence, Tuple, Union, overload

import torch
from hivemind.compression import NoCompression
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import MPFuture, ValueWithExpiration, get_logger

from swarm.hivemind_private import PrivateAverager
from swarm.server.state_transfer import StateFile, StateWriter, TensorSlot, receive_state, stream_state

__all__ = ["StateSharingAverager"]

logger = get_logger(__name__)
DECLARED_SOURCES_TIMEOUT = 30.0  # seconds to read which replicas declare their state, when a download has no timeout
State = Tuple[Any, List[torch.Tensor]]  # (metadata, tensors) of a downloaded state
SourcedState = Tuple[str, Any, List[torch.Tensor]]  # (peer id of the replica that sent it, metadata, tensors)


class StateSharingAverager(PrivateAverager):
    """hivemind's averager with state serving and downloading in bounded memory (see the module's docstring).

    :meth:`load_state_from` and :meth:`load_state_from_peers` are called in the process that created the
    averager; the serving RPC and the downloads' network side run in the averager's own process."""

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        """The state ``get_current_state`` returns, streamed part by part from its tensors: the only copy this
        process makes of it is the part being sent. A compressing ``state_compression`` is left to hivemind."""
        if not isinstance(self.state_compression, NoCompression):
            async for message in super().rpc_download_state(request, context):
                yield message
            return
        if not self.allow_state_sharing:
            return  # an empty reply: the downloader moves on to the next replica
        metadata, tensors, _ = await self.current_state_from_host()
        for message in stream_state(metadata, tensors):
            yield message

    # ---- downloading a replica's state: load_state_from and load_state_from_peers run in the peer's ----
    # ---- process, the methods after them in the averager's process ----

    @overload
    def load_state_from(
        self, peer_ids: Sequence[str], timeout: float, max_bytes: Optional[int] = None, wait: Literal[True] = True
    ) -> Optional[SourcedState]: ...

    @overload
    def load_state_from(
        self, peer_ids: Sequence[str], timeout: float, max_bytes: Optional[int] = None, *, wait: Literal[False]
    ) -> Awaitable[Optional[SourcedState]]: ...

    def load_state_from(
        self, peer_ids: Sequence[str], timeout: float, max_bytes: Optional[int] = None, wait: bool = True
    ) -> Union[Optional[SourcedState], Awaitable[Optional[SourcedState]]]:
        """Download the state of the first of ``peer_ids`` (asked one at a time, in order) that sends one.

        Returns (peer id, metadata, tensors), or None when none of them did; with ``wait=False``, an awaitable
        of that (call it from the event loop that awaits it). ``timeout``: seconds one replica's download may
        take; ``max_bytes``: the most bytes taken from one replica (None = no bound). The tensors are views of
        an unnamed temporary file that this averager's process wrote the parts into as they came: the state is
        never held twice. Nothing here checks the values: the caller decides whether to keep them (unlike
        ``load_state_from_peers``, which asks whichever replica declares the highest priority)."""
        peer_ids = [str(peer_id) for peer_id in peer_ids]
        return self._download(
            lambda future, handle: self.call_in_background(
                "_download_first",
                peer_ids=peer_ids,
                timeout=float(timeout),
                max_bytes=max_bytes,
                future=future,
                handle=handle,
            ),
            wait=wait,
            wait_s=timeout * len(peer_ids) + 5,
            with_source=True,
        )

    @overload
    def load_state_from_peers(
        self, wait: Literal[True] = True, timeout: Optional[float] = None, max_bytes: Optional[int] = None
    ) -> Optional[State]: ...

    @overload
    def load_state_from_peers(
        self, wait: Literal[False], timeout: Optional[float] = None, max_bytes: Optional[int] = None
    ) -> Awaitable[Optional[State]]: ...

    def load_state_from_peers(
        self, wait: bool = True, timeout: Optional[float] = None, max_bytes: Optional[int] = None
    ) -> Union[Optional[State], Awaitable[Optional[State]]]:
        """hivemind's ``load_state_from_peers``, received as :meth:`load_state_from` receives: (metadata, tensors)
        of the replica that declares the highest priority for this stage (the next one if it sends nothing), or
        None. ``timeout`` bounds the whole call and each replica's download (None: only each part's wait)."""
        return self._download(
            lambda future, handle: self.call_in_background(
                "_load_state_from_declared", timeout=timeout, max_bytes=max_bytes, future=future, handle=handle
            ),
            wait=wait,
            wait_s=timeout,
            with_source=False,
        )

    def _download(
        self, start: Callable[[MPFuture, Any], None], wait: bool, wait_s: Optional[float], with_source: bool
    ) -> Any:
        """Create the file a download goes into, let ``start`` hand it to the averager's process, and map the
        tensors it wrote once it is done; the file goes when the caller drops the tensors."""
        state_file, future = StateFile(), MPFuture()
        try:
            start(future, state_file.handle())
        except BaseException:
            state_file.close()
            raise
        if not wait:
            return asyncio.ensure_future(self._finish_download(state_file, future, with_source))
        try:
            return _mapped(state_file, future.result(timeout=wait_s), with_source)
        finally:
            _stop(future)
            state_file.close()

    @staticmethod
    async def _finish_download(state_file: StateFile, future: MPFuture, with_source: bool) -> Any:
        try:
            return _mapped(state_file, await future, with_source)
        finally:  # also when the caller stopped waiting: the averager's process then stops writing
            _stop(future)
            state_file.close()

    async def _load_state_from_declared(
        self, timeout: Optional[float], max_bytes: Optional[int], future: MPFuture, handle: Any
    ) -> None:
        try:
            peer_ids = await self._declared_sources(timeout)
        except Exception as e:
            logger.warning(f"could not read which replicas share their state: {type(e).__name__}: {e}")
            peer_ids = []
        if not peer_ids:
            logger.info("no other replica of this stage declares its state for download")
        await self._download_first(peer_ids, timeout, max_bytes, future, handle)

    async def _declared_sources(self, timeout: Optional[float]) -> List[str]:
        """The replicas declared in hivemind's download key, highest priority first (ties in random order), as
        hivemind's ``load_state_from_peers`` orders them; not this one."""
        key = f"{self.matchmaking.group_key_manager.prefix}.all_averagers"
        found = await asyncio.wait_for(
            self.dht.get(key, latest=True, return_future=True), timeout or DECLARED_SOURCES_TIMEOUT
        )
        declared = found.value if found is not None and isinstance(found.value, dict) else {}
        ranked = [
            (float(entry.value), random.random(), PeerID(subkey))
            for subkey, entry in declared.items()
            if isinstance(entry, ValueWithExpiration) and isinstance(entry.value, (float, int))
        ]
        return [peer.to_base58() for _, _, peer in sorted(ranked, reverse=True) if peer != self.peer_id]

    async def _download_first(
        self, peer_ids: List[str], timeout: Optional[float], max_bytes: Optional[int], future: MPFuture, handle: Any
    ) -> None:
        """Write the state of the first of ``peer_ids`` that sends one into the file ``handle`` stands for and
        resolve ``future`` with (peer id, metadata, tensor slots), or None."""
        try:
            writer = StateWriter(handle.detach())
        except Exception as e:
            logger.warning(f"state download: could not open the file it goes into: {type(e).__name__}: {e}")
            self._resolve(future, None)
            return
        try:
            with writer:
                for peer_id in peer_ids:
                    if future.done():  # the caller stopped waiting
                        return
                    try:
                        state = await asyncio.wait_for(
                            self._download_state_of(PeerID.from_base58(peer_id), writer, max_bytes, future), timeout
                        )
                    except Exception as e:
                        if not future.done():
                            logger.warning(f"state download from {peer_id} failed: {type(e).__name__}: {e}")
                        continue
                    if state is None:
                        logger.info(f"{peer_id} sent no state (it does not share it, or refused us)")
                        continue
                    self._resolve(future, (peer_id, *state))
                    return
        finally:
            self._resolve(future, None)

    @staticmethod
    def _resolve(future: MPFuture, result: Any) -> None:
        if future.done():
            return
        try:
            future.set_result(result)
        except InvalidStateError:  # the caller cancelled it meanwhile
            pass

    async def _download_state_of(
        self, peer: PeerID, writer: StateWriter, max_bytes: Optional[int], future: MPFuture
    ) -> Optional[Tuple[Any, List[TensorSlot]]]:
        """(metadata, where each tensor lies) as ``peer`` streams them into ``writer``, or None if it sent no
        metadata; a part that takes longer than ``next_chunk_timeout`` to come, more than ``max_bytes`` in all,
        a malformed part or the caller giving up ends the download (see :func:`receive_state`)."""
        stub = self.get_stub(self.background_p2p, peer, namespace=self.prefix)
        stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
        try:
            received = await receive_state(
                stream, writer, self.next_chunk_timeout or self.request_timeout, max_bytes, called_off=future.done
            )
        finally:
            if hasattr(stream, "aclose"):
                await stream.aclose()
        if received is None:
            return None
        metadata, slots = received
        return self.serializer.loads(metadata), slots


def _mapped(state_file: StateFile, result: Optional[Tuple[str, Any, List[TensorSlot]]], with_source: bool) -> Any:
    """A download's result as the caller gets it: the tensors mapped from ``state_file``."""
    if result is None:
        return None
    peer_id, metadata, slots = result
    tensors = state_file.tensors(slots)
    return (peer_id, metadata, tensors) if with_source else (metadata, tensors)


def _stop(future: MPFuture) -> None:
    if not future.done():
        future.cancel()
