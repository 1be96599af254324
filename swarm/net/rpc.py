"""Request/response calls between swarm processes over hivemind's P2P.

Messages are msgpack bytes (see :mod:`swarm.net.wire`) inside hivemind's ``ExpertRequest``
protobuf for a unary call. A call goes unary when its request and its expected reply are small, and
as a binary stream when either is above ``STREAM_THRESHOLD_BYTES``: p2pd caps unary messages at
4 MiB, and it carries a stream's bytes for far less CPU than a unary call's. Errors travel as a
reply ``{"error": ..., "kind": ...}`` so the caller gets the server's reason, not a hang.

A binary stream carries one request and one reply, each whole, after a fixed header:
``REQUEST_HEADER`` (the method name's length and the payload's length), the method name, the
payload; then ``REPLY_HEADER`` (the reply's length) and the reply. Knowing the lengths up front,
a server refuses an oversized or over-budget request before reading it, and a caller an oversized
reply. The caller closes the stream once it holds the whole reply, and the server keeps its end
open until then (at most ``LINGER_S``): a server that closed right after writing lost the tail of
about one reply in 1,000 inside p2pd, a lingering one none in 12,000.
Payloads above ``swarm.net.offload.OFF_LOOP_BYTES`` are encoded and decoded on a small thread pool, so one
large message does not stall every other request of the process.

A stage's forward and backward calls (``direct`` of :func:`call_peer`) go around p2pd, over a sealed
TCP connection to the peer's direct port (:mod:`swarm.net.direct`), once one is open; through p2pd when
none can be, or when it breaks. The server answers them with the same admission and handlers.

Lossy compression (see :mod:`swarm.net.compression`) is chosen per call: a caller passes
``compression`` to :func:`call_peer`, a servicer compresses the replies of the methods named in
``compress_replies``. Whether a call goes unary or streamed is decided on the encoded, hence
compressed, size; whether encoding is worth a thread, on the tensors' uncompressed size, which is
what compressing costs.

Kinds of :class:`RemoteError` (what the caller should do about it):

- ``bad_request``: the server refused this request as malformed; another replica will too.
- ``unavailable``: the server is joining or leaving; try another replica.
- ``internal``: the server failed unexpectedly (a bug there); try another replica.
- ``wrong_stage``: the server serves another stage; the caller's view of the swarm is stale.
- ``use_stream``: the reply is too large for a unary call; repeat the call as a stream. Callers that
  know how large a valid reply is (``expected_reply_bytes`` of :func:`call_peer`) stream such calls
  from the start, so that the server never computes a reply only to throw it away.
- ``busy``: the caller has too many requests or bytes in flight at this server; try another
  replica now and this one again soon (it is not misbehaving).
- ``unauthorized``: the server does not serve this caller.
- ``bad_reply``: raised on the caller's side only: the *server* sent an oversized or
  undecodable reply, so it misbehaved and may be banned.
"""

from __future__ import annotations

import asyncio
import struct
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Collection, Dict, Mapping, Optional, Tuple

from hivemind.p2p import P2P, P2PContext, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import get_logger

from swarm.net.compression import DEFAULT_BLOCK_SIZE, CompressionError, check_block_size, check_codec
from swarm.net.direct import (
    DIRECT_SESSION_METHOD,
    SESSION_TIMEOUT_S,
    DirectBroken,
    DirectClient,
    OversizedReply,
    direct_client_for,
)
from swarm.metrics import count_rpc_bytes, method_label
from swarm.net.offload import run_sized
from swarm.net.dialing import dialer_for, is_routing_failure
from swarm.net.wire import MAX_MESSAGE_BYTES, WireError, decode, encode, payload_size_hint

__all__ = [
    "RemoteError",
    "RPCServicer",
    "CallerBudget",
    "call_peer",
    "KINDS",
    "STREAM_THRESHOLD_BYTES",
    "NAMESPACE",
    "UNARY_REPLY_LIMIT_BYTES",
    "fits_unary_reply",
    "goes_as_stream",
    "EmptyStreamReply",
]

logger = get_logger(__name__)
NAMESPACE = "swarm"
# A request or an expected reply above this goes as a stream. Echoing 1 MiB between two daemons on loopback
# takes 8-10 ms and 7-8 ms of p2pd CPU per call as a stream, 25 ms and 36 ms as a unary call; 16 KiB costs
# about the same either way (1.7-1.9 ms), and tiny calls answer sooner unary (1.3 against 1.6 ms), opening
# no new connection to the daemon.
STREAM_THRESHOLD_BYTES = 256 * 2**10
STREAM_ATTEMPTS = 2  # a stream reply that arrives empty or cut short is asked for once more before the call fails
STREAM_HANDLER = "RPCServicer.rpc_binary"  # the binary stream handler's name, after the namespace
REQUEST_HEADER = struct.Struct(">HQ")  # method name bytes, payload bytes
REPLY_HEADER = struct.Struct(">Q")  # reply bytes
MAX_METHOD_BYTES = 256
HEADER_TIMEOUT_S = 30.0  # a caller that opened a stream sends its header within this
MIN_UPLOAD_BYTES_PER_S = 32 * 2**10  # a request's payload arrives within HEADER_TIMEOUT_S + its size at this rate
LINGER_S = 30.0  # how long a server keeps a stream open after its reply, waiting for the caller to close it
UNARY_REPLY_LIMIT_BYTES = 3 * 2**20 + 2**19
REPLY_ENVELOPE_BYTES = 64 * 2**10  # what a reply may add to its tensors (keys, shapes, a step, a digest)
MAX_ERROR_CHARS = 1000  # an error reply echoes at most this much of its reason
MAX_REPORTED_CALLERS = 1024  # unauthorized callers remembered so that each is logged once
KINDS = ("bad_request", "unavailable", "internal", "wrong_stage", "use_stream", "busy", "unauthorized", "bad_reply")
# what a handler raises for input it refuses; anything else escaping a handler is a bug of the server
BAD_INPUT_ERRORS = (ValueError, TypeError, KeyError, IndexError, OverflowError)  # WireError is a ValueError

Handler = Callable[[Dict[str, Any], str], Awaitable[Mapping[str, Any]]]


class RemoteError(RuntimeError):
    """The remote peer answered with an error, or (``bad_reply``) with garbage; ``kind`` is one of :data:`KINDS`."""

    def __init__(self, message: str, kind: str = "internal"):
        super().__init__(message)
        self.kind = kind


def fits_unary_reply(expected_reply_bytes: int) -> bool:
    """Whether a reply of about ``expected_reply_bytes`` (its tensors, encoded) can come back in a unary call;
    :data:`REPLY_ENVELOPE_BYTES` leaves room for the keys and msgpack framing around them."""
    return expected_reply_bytes + REPLY_ENVELOPE_BYTES <= UNARY_REPLY_LIMIT_BYTES


def goes_as_stream(request_bytes: int, expected_reply_bytes: int) -> bool:
    """Whether a call with this encoded request and a reply of about ``expected_reply_bytes`` goes as a
    stream: when either is above :data:`STREAM_THRESHOLD_BYTES` (cheaper for p2pd), or the reply cannot
    come back in a unary call at all."""
    return (
        request_bytes > STREAM_THRESHOLD_BYTES
        or expected_reply_bytes > STREAM_THRESHOLD_BYTES
        or not fits_unary_reply(expected_reply_bytes)
    )


def _error(message: str, kind: str) -> bytes:
    if len(message) > MAX_ERROR_CHARS:
        message = message[:MAX_ERROR_CHARS] + "..."
    return encode({"error": message, "kind": kind})


async def _decode(payload: bytes, max_bytes: int) -> Dict[str, Any]:
    return await run_sized(len(payload), decode, payload, max_bytes)


async def _encode(message: Mapping[str, Any], compression: str = "none", block_size: int = DEFAULT_BLOCK_SIZE) -> bytes:
    return await run_sized(payload_size_hint(message), encode, message, compression, block_size)


class CallerBudget:
    """Requests and request bytes in flight per caller, against fixed limits.

    Plain bookkeeping with no I/O, used from one event loop. An entry disappears when its
    caller has nothing in flight, so memory is bounded by the requests being served.
    """

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests, self.max_bytes = max_requests, max_bytes
        self._in_flight: Dict[str, Tuple[int, int]] = {}  # caller -> (requests, bytes)

    def admit(self, caller: str, num_bytes: int = 0) -> bool:
        """Count one more request of ``caller`` holding ``num_bytes``; False (and nothing counted) if over a limit."""
        requests, held = self._in_flight.get(caller, (0, 0))
        if requests + 1 > self.max_requests or held + num_bytes > self.max_bytes:
            return False
        self._in_flight[caller] = (requests + 1, held + num_bytes)
        return True

    def grow(self, caller: str, num_bytes: int) -> bool:
        """Add ``num_bytes`` to an admitted request (a stream chunk); False (and nothing added) if over the limit."""
        requests, held = self._in_flight[caller]
        if held + num_bytes > self.max_bytes:
            return False
        self._in_flight[caller] = (requests, held + num_bytes)
        return True

    def release(self, caller: str, num_bytes: int) -> None:
        """End one admitted request of ``caller`` that held ``num_bytes`` in all."""
        requests, held = self._in_flight[caller]
        if requests <= 1:
            del self._in_flight[caller]
        else:
            self._in_flight[caller] = (requests - 1, held - num_bytes)

    def in_flight(self, caller: str) -> Tuple[int, int]:
        return self._in_flight.get(caller, (0, 0))

    def __len__(self) -> int:
        return len(self._in_flight)


class RPCServicer(ServicerBase):
    """Routes every incoming call to ``handlers[method](message, caller_peer_id)``.

    Runs in the event loop of the process that owns the P2P instance. Before a handler runs,
    a caller that ``authorize`` rejects gets 'unauthorized' and one over its budget
    (``max_requests_per_caller`` requests or ``max_bytes_per_caller`` bytes in flight) gets
    'busy'. Handlers raise one of :data:`BAD_INPUT_ERRORS` (:class:`WireError` included) for
    input they refuse: it becomes 'bad_request' with no traceback logged. :class:`RemoteError`
    keeps its kind; anything else is a bug, logged with its traceback, and becomes 'internal'.
    The server keeps serving everyone else in all cases.

    Replies of the methods in ``compress_replies`` are encoded with ``compression`` (every other
    reply goes exact); one whose tensors cannot be compressed (NaN, inf, float16 overflow) becomes
    an 'internal' error reply that says so, since the values came from this server.
    """

    def __init__(
        self,
        handlers: Mapping[str, Handler],
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        *,
        max_requests_per_caller: int = 64,
        max_bytes_per_caller: Optional[int] = None,
        authorize: Optional[Callable[[str], bool]] = None,
        compression: str = "none",
        block_size: int = DEFAULT_BLOCK_SIZE,
        compress_replies: Collection[str] = (),
    ):
        max_bytes_per_caller = 4 * max_message_bytes if max_bytes_per_caller is None else max_bytes_per_caller
        if max_message_bytes < 1 or max_requests_per_caller < 1:
            raise ValueError("max_message_bytes and max_requests_per_caller must be at least 1")
        if max_bytes_per_caller < max_message_bytes:
            raise ValueError(
                f"max_bytes_per_caller ({max_bytes_per_caller}) must be at least max_message_bytes "
                f"({max_message_bytes}), or no caller could send a message of the largest size"
            )
        self.handlers = dict(handlers)
        self.max_message_bytes = max_message_bytes
        self.budget = CallerBudget(max_requests_per_caller, max_bytes_per_caller)
        self.authorize = authorize
        self.compression, self.block_size = check_codec(compression), check_block_size(block_size)
        self.compress_replies = frozenset(compress_replies)
        self._reported: "OrderedDict[str, None]" = OrderedDict()  # unauthorized callers already logged

    # ---- admission ----

    def _refusal(self, caller: str) -> Optional[bytes]:
        """An 'unauthorized' reply for a caller that ``authorize`` rejects, logged once per caller; an
        'internal' one if ``authorize`` itself fails; else None."""
        try:
            if self.authorize is None or self.authorize(caller):
                return None
        except Exception as e:
            logger.exception(f"authorize({caller}) failed")
            return _error(f"authorization failed on the server: {type(e).__name__}", "internal")
        if caller not in self._reported:
            logger.warning(f"refusing calls from unauthorized peer {caller}")
            self._reported[caller] = None
            while len(self._reported) > MAX_REPORTED_CALLERS:
                self._reported.popitem(last=False)
        return _error("this peer does not serve you", "unauthorized")

    def _busy(self, caller: str) -> bytes:
        requests, held = self.budget.in_flight(caller)
        logger.debug(f"caller {caller} is over its budget ({requests} requests, {held} bytes in flight)")
        return _error(
            f"too many requests in flight from you ({requests} requests, {held} bytes; limits "
            f"{self.budget.max_requests} requests, {self.budget.max_bytes} bytes): try another peer",
            "busy",
        )

    # ---- serving ----

    async def _dispatch(self, method: str, payload: bytes, caller: PeerID) -> bytes:
        """Answer one whole request (a unary call): admission, then :meth:`_handle`."""
        caller_id = str(caller)
        refusal = self._refusal(caller_id)
        if refusal is not None:
            return refusal
        if not self.budget.admit(caller_id, len(payload)):
            return self._busy(caller_id)
        try:
            return await self._handle(method, payload, caller_id)
        finally:
            self.budget.release(caller_id, len(payload))

    async def _handle(self, method: str, payload: bytes, caller: str) -> bytes:
        """Decode, run the handler, encode: every failure becomes an error reply of the right kind."""
        handler = self.handlers.get(method)
        try:
            if handler is None:
                raise RemoteError(
                    f"unknown method {method[:64]!r}; this peer serves {sorted(self.handlers)}", "bad_request"
                )
            reply = await handler(await _decode(payload, self.max_message_bytes), caller)
        except RemoteError as e:
            return _error(str(e), e.kind)
        except BAD_INPUT_ERRORS as e:
            logger.debug(f"bad request to {method[:64]!r} from {caller}: {type(e).__name__}: {e}")
            return _error(f"bad request to {method[:64]}: {e}", "bad_request")
        except Exception as e:
            logger.exception(f"{method[:64]} from {caller} failed")
            return _error(f"{method[:64]} failed on the server: {type(e).__name__}: {e}", "internal")
        return await self._encode_reply(method, reply, caller)

    async def _encode_reply(self, method: str, reply: Mapping[str, Any], caller: str) -> bytes:
        compression = self.compression if method in self.compress_replies else "none"
        try:
            return await _encode(reply, compression, self.block_size)
        except CompressionError as e:
            logger.warning(f"the reply of {method[:64]} to {caller} cannot be sent in {compression}: {e}")
            return _error(
                f"{method[:64]} failed on the server: its reply cannot be compressed to {compression} ({e})", "internal"
            )
        except Exception as e:
            logger.exception(f"the reply of {method[:64]} to {caller} cannot be encoded")
            return _error(f"{method[:64]} failed on the server: unencodable reply ({type(e).__name__})", "internal")

    async def rpc_unary(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        reply = await self._dispatch(request.uid, request.metadata, context.remote_id)
        if len(reply) > UNARY_REPLY_LIMIT_BYTES:
            reply = encode({"error": "reply too large for a unary call", "kind": "use_stream"})
        self.meter(request.uid, len(request.metadata), len(reply))
        return runtime_pb2.ExpertResponse(metadata=reply)

    async def add_p2p_handlers(
        self, p2p: P2P, wrapper: Any = None, *, namespace: Optional[str] = None, balanced: bool = False
    ) -> None:
        """Serve ``rpc_unary`` (hivemind's protobuf handler) and the binary stream handler on ``p2p``."""
        await super().add_p2p_handlers(p2p, wrapper, namespace=namespace, balanced=balanced)
        await p2p.add_binary_stream_handler(_stream_handler_name(namespace), self.serve_stream, balanced=balanced)

    async def remove_p2p_handlers(self, p2p: P2P, *, namespace: Optional[str] = None) -> None:
        await super().remove_p2p_handlers(p2p, namespace=namespace)
        await p2p.remove_binary_stream_handler(_stream_handler_name(namespace))

    def meter(self, method: str, received: int, sent: int) -> None:
        label = method_label(method, self.handlers)  # callers choose method names: only ours become labels
        count_rpc_bytes(label, "received", received)
        count_rpc_bytes(label, "sent", sent)

    async def serve_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Answer the one request of a binary stream, then keep the stream open until the caller closes it."""
        caller = str(info.peer_id)
        try:
            answered = await self._answer_stream(reader, caller)
            if answered is None:
                return  # the caller broke off, or never sent what it announced: there is no one to answer
            method, received, reply = answered
            writer.write(REPLY_HEADER.pack(len(reply)))
            writer.write(reply)
            await writer.drain()
            self.meter(method, received, len(reply))
            await _linger(reader)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
            logger.debug(f"a stream from {caller} ended early: {type(e).__name__}: {e}")
        finally:
            writer.close()

    async def _answer_stream(self, reader: asyncio.StreamReader, caller: str) -> Optional[Tuple[str, int, bytes]]:
        """(method, request bytes read, reply) for the request on ``reader``; None if it never arrived whole."""
        method_bytes, size = REQUEST_HEADER.unpack(
            await asyncio.wait_for(reader.readexactly(REQUEST_HEADER.size), HEADER_TIMEOUT_S)
        )
        if method_bytes > MAX_METHOD_BYTES:
            return (
                "",
                0,
                _error(f"a method name of {method_bytes} bytes exceeds {MAX_METHOD_BYTES} bytes", "bad_request"),
            )
        method = (await asyncio.wait_for(reader.readexactly(method_bytes), HEADER_TIMEOUT_S)).decode("utf-8", "replace")

        async def read() -> Optional[bytes]:
            try:
                return await asyncio.wait_for(reader.readexactly(size), payload_timeout(size))
            except (asyncio.IncompleteReadError, asyncio.TimeoutError):
                return None

        reply, consumed = await self.answer(method, size, caller, read)
        return None if reply is None else (method, size if consumed else 0, reply)

    async def answer(
        self, method: str, size: int, caller: str, read: Callable[[], Awaitable[Optional[bytes]]]
    ) -> Tuple[Optional[bytes], bool]:
        """The reply to a request of ``size`` bytes whose payload ``read()`` returns (None if it never
        arrived whole: then there is no one to answer), and whether the payload was read.

        A refused caller, one over its budget and an oversized request are answered from the size
        alone, without reading the payload: the caller reads the reply while it is still sending."""
        refusal = self._refusal(caller)
        if refusal is not None:
            return refusal, False
        if size > self.max_message_bytes:
            return _error(
                f"message of {size} bytes exceeds this peer's limit of {self.max_message_bytes} bytes", "bad_request"
            ), False
        if not self.budget.admit(caller, size):
            return self._busy(caller), False
        try:
            payload = await read()
            return (None if payload is None else await self._handle(method, payload, caller)), True
        finally:
            self.budget.release(caller, size)


def payload_timeout(size: int) -> float:
    """Seconds a request's payload of ``size`` bytes may take to arrive once its header has."""
    return HEADER_TIMEOUT_S + size / MIN_UPLOAD_BYTES_PER_S


def _stream_handler_name(namespace: Optional[str]) -> str:
    return STREAM_HANDLER if namespace is None else f"{namespace}::{STREAM_HANDLER}"


async def _linger(reader: asyncio.StreamReader) -> None:
    """Wait (at most ``LINGER_S``) for the caller to close the stream, discarding whatever it still sends."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + LINGER_S
    while loop.time() < deadline:
        if not await asyncio.wait_for(reader.read(2**16), deadline - loop.time()):
            return


# ---- calling ----


async def _call_stream(
    p2p: P2P, peer_id: PeerID, method: str, payload: bytes, max_reply_bytes: int, namespace: str = NAMESPACE
) -> bytes:
    """Send ``payload`` on a binary stream and return the reply, refusing (as 'bad_reply') a reply
    announced larger than ``max_reply_bytes``. The reply is read while the request is still being sent, so a
    server that answers from the header (refused, busy, too large) is heard at once."""
    name = method.encode("utf-8")
    if len(name) > MAX_METHOD_BYTES:
        raise ValueError(f"method name of {len(name)} bytes exceeds {MAX_METHOD_BYTES} bytes")
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, _stream_handler_name(namespace))
    sending = asyncio.ensure_future(_send_request(writer, name, payload))
    received = 0
    try:
        try:
            (size,) = REPLY_HEADER.unpack(await reader.readexactly(REPLY_HEADER.size))
        except asyncio.IncompleteReadError as e:
            raise EmptyStreamReply(f"the stream of {method} ended without a reply") from _sending_error(sending, e)
        if size > max_reply_bytes:
            raise RemoteError(f"stream reply to {method} of {size} bytes exceeds {max_reply_bytes} bytes", "bad_reply")
        try:
            reply = await reader.readexactly(size)
        except asyncio.IncompleteReadError as e:
            raise EmptyStreamReply(
                f"the stream of {method} ended {len(e.partial)} bytes into a reply of {size}"
            ) from None
        received = REPLY_HEADER.size + size
        return reply
    finally:
        if sending.done() and not sending.cancelled():
            sending.exception()  # retrieved: a send cut short by the server's early answer is no error
        sending.cancel()  # a server that answered from the header does not read the rest
        writer.close()  # the server keeps its end open until we close ours: the whole reply is here
        count_rpc_bytes(method_label(method), "sent", len(payload))
        count_rpc_bytes(method_label(method), "received", received)


async def _send_request(writer: asyncio.StreamWriter, name: bytes, payload: bytes) -> None:
    writer.write(REQUEST_HEADER.pack(len(name), len(payload)) + name)
    writer.write(payload)
    await writer.drain()


def _sending_error(sending: "asyncio.Future[None]", fallback: BaseException) -> BaseException:
    """Why the request could not be sent, if it could not (the real cause of a stream that ended early)."""
    error = sending.exception() if sending.done() and not sending.cancelled() else None
    return fallback if error is None else error


class EmptyStreamReply(ConnectionError):
    """A stream ended before its reply was whole. It happens to honest servers now and then (p2pd loses a
    stream's tail), so the call is asked for once more before it fails."""


async def _call_stream_retrying(p2p: P2P, peer_id: PeerID, method: str, payload: bytes, max_reply_bytes: int) -> bytes:
    """:func:`_call_stream`, asked once more (``STREAM_ATTEMPTS`` in all) when the reply is lost. The server
    then serves the request twice: stage calls are safe to repeat (a backward already accumulated is not
    counted again)."""
    for _ in range(STREAM_ATTEMPTS - 1):
        try:
            return await _call_stream(p2p, peer_id, method, payload, max_reply_bytes)
        except EmptyStreamReply as e:
            logger.debug(f"{e}; asking once more")
    return await _call_stream(p2p, peer_id, method, payload, max_reply_bytes)


def _direct_client(p2p: P2P) -> DirectClient:
    """This process's direct connections over ``p2p``, which ask peers for sessions through p2pd."""

    async def ask(peer_id: str) -> Dict[str, Any]:
        return await call_peer(p2p, PeerID.from_base58(peer_id), DIRECT_SESSION_METHOD, {}, timeout=SESSION_TIMEOUT_S)

    return direct_client_for(p2p, ask)


async def _call_direct(p2p: P2P, peer_id: PeerID, method: str, payload: bytes, max_reply_bytes: int) -> Optional[bytes]:
    """The reply from the peer's direct port (:mod:`swarm.net.direct`); None if no connection to it is open yet
    (one is being opened meanwhile) or the connection broke: then the call goes through p2pd."""
    direct = _direct_client(p2p)
    channel = direct.channel(str(peer_id))
    if channel is None:
        return None
    try:
        return await direct.call(str(peer_id), channel, method, payload, max_reply_bytes)
    except OversizedReply as e:
        raise RemoteError(f"{e} to {method}", "bad_reply") from None
    except DirectBroken as e:
        logger.debug(f"{e}; sending {method} through p2pd")
        return None


async def _call_unary(stub, method: str, payload: bytes, max_reply_bytes: int) -> bytes:
    response = await stub.rpc_unary(runtime_pb2.ExpertRequest(uid=method, metadata=payload))
    count_rpc_bytes(method_label(method), "sent", len(payload))
    count_rpc_bytes(method_label(method), "received", len(response.metadata))
    if len(response.metadata) > max_reply_bytes:
        raise RemoteError(
            f"unary reply to {method} of {len(response.metadata)} bytes exceeds {max_reply_bytes} bytes", "bad_reply"
        )
    return response.metadata


async def _encode_request(message: Mapping[str, Any], compression: str, block_size: int) -> bytes:
    """``message`` in ``compression``, or exact where its tensors cannot be compressed: they are the
    caller's own values, no fault of the peer called, and every receiver decodes both forms."""
    try:
        return await _encode(message, compression, block_size)
    except CompressionError as e:
        logger.debug(f"sending a request uncompressed: {e}")
        return await _encode(message)


async def call_peer(
    p2p: P2P,
    peer_id: PeerID,
    method: str,
    message: Mapping[str, Any],
    *,
    timeout: float,
    stream: bool = False,
    max_reply_bytes: int = MAX_MESSAGE_BYTES,
    compression: str = "none",
    block_size: int = DEFAULT_BLOCK_SIZE,
    expected_reply_bytes: int = 0,
    direct: bool = False,
) -> Dict[str, Any]:
    """Call ``method`` on ``peer_id`` and return its decoded reply, within ``timeout`` seconds.

    A call with ``direct`` (a stage's forward or backward) goes straight to the peer's direct port once
    a connection to it is open (:mod:`swarm.net.direct`; the first such call starts opening one). Otherwise,
    a call whose request, or whose reply expected to take ``expected_reply_bytes`` (encoded), is large
    goes as a stream (:func:`goes_as_stream`), and any other unary, repeated as a stream only if the
    server answers 'use_stream' (its reply turned out larger than a unary call carries).

    With ``compression`` ``"fp16"`` or ``"int8"`` the request's float tensors travel compressed
    (blocks of ``block_size`` values for int8); the reply is whatever the peer sends, decoded.
    Raises :class:`RemoteError` if the peer answered with an error (with the peer's kind) or
    with an oversized or undecodable reply (kind 'bad_reply'), ``asyncio.TimeoutError`` on
    timeout, and connection errors as they come from p2pd.
    """
    check_codec(compression)
    check_block_size(block_size)
    stub = RPCServicer.get_stub(p2p, peer_id, namespace=NAMESPACE)
    dialer = dialer_for(p2p)

    async def _reply(payload: bytes) -> Dict[str, Any]:
        try:
            return await _decode(payload, max_reply_bytes)
        except WireError as e:
            raise RemoteError(f"peer {peer_id} sent an undecodable reply to {method}: {e}", "bad_reply") from None

    async def _call() -> Dict[str, Any]:
        await dialer.ensure(str(peer_id))
        payload = await _encode_request(message, compression, block_size)
        try:
            return await _send(payload)
        except Exception as e:
            # p2pd did not know where the peer is: dial its announced addresses and try once more
            if (
                isinstance(e, RemoteError)
                or not is_routing_failure(e)
                or not await dialer.ensure(str(peer_id), force=True)
            ):
                raise
        return await _send(payload)

    async def _send(payload: bytes) -> Dict[str, Any]:
        large = stream or goes_as_stream(len(payload), expected_reply_bytes)
        raw = await _call_direct(p2p, peer_id, method, payload, max_reply_bytes) if direct else None
        if raw is not None:
            reply = await _reply(raw)
        elif large:
            reply = await _reply(await _call_stream_retrying(p2p, peer_id, method, payload, max_reply_bytes))
        else:
            reply = await _reply(await _call_unary(stub, method, payload, max_reply_bytes))
            if reply.get("kind") == "use_stream":
                reply = await _reply(await _call_stream_retrying(p2p, peer_id, method, payload, max_reply_bytes))
        if "error" in reply:
            kind = reply.get("kind")
            raise RemoteError(str(reply["error"])[:MAX_ERROR_CHARS], kind if kind in KINDS else "internal")
        return reply

    return await asyncio.wait_for(_call(), timeout=timeout)
