"""Request/response calls between swarm processes over hivemind's P2P.

Messages are msgpack bytes (see :mod:`swarm.wire`) inside hivemind's ``ExpertRequest``
protobuf. Small messages go as one unary call; anything above ``STREAM_THRESHOLD_BYTES``
goes as a stream of chunks, because p2pd caps unary messages at 4 MiB. Errors travel as a
reply ``{"error": ..., "kind": ...}`` so the caller gets the server's reason, not a hang.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable, Dict, List, Mapping

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import get_logger

from swarm.wire import MAX_MESSAGE_BYTES, WireError, decode, encode

__all__ = ["RemoteError", "RPCServicer", "call_peer", "STREAM_THRESHOLD_BYTES", "NAMESPACE"]

logger = get_logger(__name__)
NAMESPACE = "swarm"
STREAM_THRESHOLD_BYTES = 2 * 2**20  # unary below this, chunked stream above (p2pd caps unary at 4 MiB)
CHUNK_BYTES = 2 * 2**20
UNARY_REPLY_LIMIT_BYTES = 3 * 2**20 + 2**19
DRAIN_LIMIT_FACTOR = 4  # an oversized request is read (and dropped) up to this many times the limit

Handler = Callable[[Dict[str, Any], str], Awaitable[Mapping[str, Any]]]


class RemoteError(RuntimeError):
    """The remote peer answered with an error. ``kind`` is 'bad_request', 'unavailable' or 'internal'."""

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind


def _chunks(payload: bytes) -> List[bytes]:
    return [payload[i : i + CHUNK_BYTES] for i in range(0, len(payload), CHUNK_BYTES)] or [b""]


class RPCServicer(ServicerBase):
    """Routes every incoming call to ``handlers[method](message, caller_peer_id)``.

    Runs in the event loop of the process that owns the P2P instance. Handlers must never
    raise for bad input on purpose: a ``ValueError`` (including :class:`WireError`) becomes a
    'bad_request' reply, :class:`RemoteError` keeps its kind, anything else is logged and
    becomes 'internal'. The server keeps serving everyone else in all cases.
    """

    def __init__(self, handlers: Mapping[str, Handler], max_message_bytes: int = MAX_MESSAGE_BYTES):
        self.handlers = dict(handlers)
        self.max_message_bytes = max_message_bytes

    async def _dispatch(self, method: str, payload: bytes, caller: PeerID) -> bytes:
        handler = self.handlers.get(method)
        try:
            if handler is None:
                raise RemoteError(f"unknown method {method!r}; this peer serves {sorted(self.handlers)}", "bad_request")
            reply = await handler(decode(payload, self.max_message_bytes), str(caller))
            return encode(reply)
        except RemoteError as e:
            return encode({"error": str(e), "kind": e.kind})
        except (ValueError, TypeError, KeyError) as e:
            return encode({"error": f"bad request to {method}: {e}", "kind": "bad_request"})
        except Exception as e:
            logger.exception(f"{method} from {caller} failed")
            return encode({"error": f"{method} failed on the server: {type(e).__name__}: {e}", "kind": "internal"})

    async def rpc_unary(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        reply = await self._dispatch(request.uid, request.metadata, context.remote_id)
        if len(reply) > UNARY_REPLY_LIMIT_BYTES:
            reply = encode({"error": "reply too large for a unary call", "kind": "use_stream"})
        return runtime_pb2.ExpertResponse(metadata=reply)

    async def rpc_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context: P2PContext
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        method, parts, size = None, [], 0
        async for request in requests:
            method = method or request.uid
            size += len(request.metadata)
            if size <= self.max_message_bytes:
                parts.append(request.metadata)
            elif size > DRAIN_LIMIT_FACTOR * self.max_message_bytes:
                break  # stop reading: the caller's stream is reset, which is all an abuser deserves
            # else: keep reading (and discarding) so that the caller gets our answer, not a reset stream
        if size > self.max_message_bytes:
            reply = encode({"error": f"message of {size}+ bytes exceeds this peer's limit of {self.max_message_bytes} bytes",
                            "kind": "bad_request"})
        else:
            reply = await self._dispatch(method or "", b"".join(parts), context.remote_id)
        for chunk in _chunks(reply):
            yield runtime_pb2.ExpertResponse(metadata=chunk)


async def _call_stream(stub, method: str, payload: bytes) -> bytes:
    async def requests():
        for chunk in _chunks(payload):
            yield runtime_pb2.ExpertRequest(uid=method, metadata=chunk)

    parts = [response.metadata async for response in await stub.rpc_stream(requests())]
    if not parts:  # p2pd occasionally ends a stream without data or error
        raise ConnectionError(f"empty stream reply to {method}")
    return b"".join(parts)


async def call_peer(
    p2p: P2P, peer_id: PeerID, method: str, message: Mapping[str, Any], *, timeout: float, stream: bool = False
) -> Dict[str, Any]:
    """Call ``method`` on ``peer_id`` and return its decoded reply, within ``timeout`` seconds.

    Raises :class:`RemoteError` if the peer answered with an error, ``asyncio.TimeoutError``
    on timeout, and connection errors as they come from p2pd.
    """
    stub = RPCServicer.get_stub(p2p, peer_id, namespace=NAMESPACE)
    payload = encode(message)

    async def _call() -> Dict[str, Any]:
        if stream or len(payload) > STREAM_THRESHOLD_BYTES:
            reply = decode(await _call_stream(stub, method, payload))
        else:
            response = await stub.rpc_unary(runtime_pb2.ExpertRequest(uid=method, metadata=payload))
            reply = decode(response.metadata)
            if reply.get("kind") == "use_stream":
                reply = decode(await _call_stream(stub, method, payload))
        if "error" in reply:
            raise RemoteError(str(reply["error"]), str(reply.get("kind", "internal")))
        return reply

    try:
        return await asyncio.wait_for(_call(), timeout=timeout)
    except WireError as e:
        raise RemoteError(f"peer {peer_id} sent an undecodable reply: {e}", "internal") from None
