"""Large calls sent straight over TCP between two processes, around the p2pd daemons.

Every byte of a p2pd stream crosses two daemons (a unix socket, yamux, Noise and TCP on each side),
and on a 2-stage swarm that costs as much CPU as a tenth of the compute. So a stage peer also listens
on a plain TCP port (:class:`DirectServer`), and a caller that can reach that port sends its large
requests there (:class:`DirectClient`). Everything else goes through p2pd as before: small calls, calls
to a peer whose port cannot be reached (behind NAT, a firewall, ``--direct_port -1``), and any call
whose direct connection broke.

Trust comes from p2pd. A caller asks for a session with an ordinary p2pd call (``direct_session``),
which libp2p authenticates, and gets a random key bound to its peer id. A TCP connection opens with
the session's id and a random salt from the caller, answered by a random salt from the server; both
derive the connection's key from the session key and both salts, and every frame after that is sealed
with AES-GCM under a counter nonce (its direction and its sequence number). So the server knows which
peer sent each request, nobody on the path can read or alter a tensor, and a recorded connection
cannot be replayed (the server's salt is new each time).

A request frame is ``FRAME_HEADER`` (the method's length and the sealed payload's length), the method
(in the clear, authenticated with the header as associated data) and the sealed payload; a reply
frame is ``REPLY_HEADER`` and the sealed reply. A connection carries one call at a time; a caller
keeps a few idle connections per peer.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
import struct
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hivemind.p2p import P2P
from hivemind.utils import get_logger
from hivemind.utils.multiaddr import Multiaddr

from swarm.metrics import count_rpc_bytes, method_label
from swarm.net.offload import run_sized
from swarm.net.addresses import dialable, ip_hosts, is_circuit, is_wildcard
from swarm.net.dialing import address_book

__all__ = [
    "DIRECT_SESSION_METHOD",
    "DirectServer",
    "DirectClient",
    "DirectBroken",
    "OversizedReply",
    "direct_client_for",
    "listen_hosts",
    "connection_key",
    "Sealer",
]

logger = get_logger(__name__)

DIRECT_SESSION_METHOD = "direct_session"
SESSION_ID_BYTES, SALT_BYTES, KEY_BYTES, TAG_BYTES = 16, 16, 32, 16
FRAME_HEADER = struct.Struct(">HQ")  # method bytes, sealed payload bytes
REPLY_HEADER = struct.Struct(">Q")  # sealed reply bytes
MAX_METHOD_BYTES = 256
HELLO_TIMEOUT_S = 10.0  # a connection names its session within this
IDLE_TIMEOUT_S = 120.0  # a server closes a connection that carried no request for this long
CLIENT_IDLE_S = IDLE_TIMEOUT_S / 2  # a caller reuses an idle connection only this long
CONNECT_TIMEOUT_S = 3.0  # seconds one attempt to open a connection may take
SESSION_TIMEOUT_S = 10.0  # seconds the p2pd call asking for a session may take
UNREACHABLE_RETRY_S = 600.0  # a peer whose port could not be reached is tried again after this
BROKEN_RETRY_S = 30.0  # a peer whose connection broke mid-call is tried again after this
MAX_SESSIONS = 4096  # sessions a server remembers (the oldest is forgotten first)
MAX_CONNECTIONS = 512  # connections a server holds open at once
MAX_IDLE_PER_PEER = 8  # idle connections a caller keeps per peer
SWEEP_PERIOD_S = 30.0  # how often a caller closes idle connections too old to reuse
_CONTEXT = b"swarm direct transfer v1"


class DirectBroken(ConnectionError):
    """A direct connection failed before its reply was whole: the call should go through p2pd instead."""


def connection_key(session_key: bytes, client_salt: bytes, server_salt: bytes) -> bytes:
    """The AES-256 key of one connection: fresh for every pair of salts, so counters may start at 0."""
    return hmac.new(session_key, _CONTEXT + client_salt + server_salt, hashlib.sha256).digest()


class Sealer:
    """One connection's AES-GCM, one side of it. Frames are sealed and opened in order: the nonce is the
    frame's direction and its sequence number, so a frame dropped, repeated or moved fails to open."""

    def __init__(self, key: bytes, sending: int):
        self._aead = AESGCM(key)
        self._sending, self._sent, self._received = sending, 0, 0

    @staticmethod
    def _nonce(direction: int, counter: int) -> bytes:
        return direction.to_bytes(4, "big") + counter.to_bytes(8, "big")

    def next_seal(self) -> Callable[[bytes, bytes], bytes]:
        """A function sealing the next frame sent (its nonce taken now, so that it may run on another thread)."""
        nonce = self._nonce(self._sending, self._sent)
        self._sent += 1
        return lambda payload, associated: self._aead.encrypt(nonce, payload, associated)

    def next_open(self) -> Callable[[bytes, bytes], bytes]:
        """A function opening the next frame received; it raises ``InvalidTag`` for a frame not sealed by the
        other side of this connection, in this position."""
        nonce = self._nonce(1 - self._sending, self._received)
        self._received += 1
        return lambda sealed, associated: self._aead.decrypt(nonce, sealed, associated)


def listen_hosts(host_maddrs: Iterable[str]) -> List[str]:
    """The IP hosts a process's p2pd listens on (a wildcard alone if there is one), where its direct
    port listens too; DNS names and relay addresses are left out."""
    hosts = ip_hosts(host_maddrs)
    return [h for h in hosts if is_wildcard(h)] or hosts


# ---- serving ----


@dataclass
class _Session:
    caller: str
    key: bytes


class DirectServer:
    """Serves the requests of authenticated callers on a TCP port with ``servicer.answer``.

    ``servicer`` is an :class:`swarm.net.rpc.RPCServicer`; :meth:`session` is the handler of
    :data:`DIRECT_SESSION_METHOD` that it serves through p2pd."""

    def __init__(self, servicer: Any, hosts: Sequence[str], port: int, payload_timeout: Callable[[int], float]):
        if not hosts:
            raise ValueError("a direct server needs a host to listen on")
        self.servicer, self.hosts, self.port = servicer, list(hosts), port
        self.payload_timeout = payload_timeout  # seconds a request's payload of so many bytes may take
        self._sessions: "OrderedDict[bytes, _Session]" = OrderedDict()
        self._session_of: Dict[str, bytes] = {}  # caller -> its session id: one each, the latest
        self._servers: List[asyncio.AbstractServer] = []
        self._writers: Set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        """Listen on every host, on ``port`` (0: a free one, the same for every host); return the port."""
        for host in self.hosts:
            server = await asyncio.start_server(self._serve, host, self.port)
            self.port = server.sockets[0].getsockname()[1]
            self._servers.append(server)
        return self.port

    def close(self) -> None:
        """Stop listening and close every connection (a caller's call in flight goes through p2pd instead)."""
        for server in self._servers:
            server.close()
        for writer in list(self._writers):
            writer.close()
        self._servers = []

    async def session(self, message: Mapping[str, Any], caller: str) -> Dict[str, Any]:
        """A new session for ``caller`` (the peer p2pd authenticated): its id, its key and the port. It replaces
        the caller's previous session (connections already open keep working), so that no caller can push
        the others' sessions out by asking again and again."""
        previous = self._session_of.pop(caller, None)
        if previous is not None:
            self._sessions.pop(previous, None)
        session_id, key = os.urandom(SESSION_ID_BYTES), os.urandom(KEY_BYTES)
        self._sessions[session_id] = _Session(caller, key)
        self._session_of[caller] = session_id
        while len(self._sessions) > MAX_SESSIONS:
            _, oldest = self._sessions.popitem(last=False)
            self._session_of.pop(oldest.caller, None)
        return {"session": session_id, "key": key, "port": self.port}

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._writers) >= MAX_CONNECTIONS:
            writer.close()
            return
        self._writers.add(writer)
        try:
            hello = await asyncio.wait_for(reader.readexactly(SESSION_ID_BYTES + SALT_BYTES), HELLO_TIMEOUT_S)
            session = self._sessions.get(hello[:SESSION_ID_BYTES])
            if session is None:
                return  # unknown or forgotten: the caller asks for a new session through p2pd
            server_salt = os.urandom(SALT_BYTES)
            writer.write(server_salt)
            sealer = Sealer(connection_key(session.key, hello[SESSION_ID_BYTES:], server_salt), sending=1)
            while await self._serve_one(reader, writer, sealer, session.caller):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.TimeoutError, InvalidTag) as e:
            logger.debug(f"a direct connection ended: {type(e).__name__}: {e}")
        except asyncio.CancelledError:
            # the loop is shutting down: end quietly, since asyncio's stream callback on Python 3.11 logs a
            # cancelled connection task as an unhandled error
            logger.debug("a direct connection was cancelled")
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _serve_one(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, sealer: Sealer, caller: str
    ) -> bool:
        """Answer the next request on the connection; False when the connection is to be closed."""
        header = await asyncio.wait_for(reader.readexactly(FRAME_HEADER.size), IDLE_TIMEOUT_S)
        method_bytes, sealed_size = FRAME_HEADER.unpack(header)
        if method_bytes > MAX_METHOD_BYTES or sealed_size < TAG_BYTES:
            return False
        name = await asyncio.wait_for(reader.readexactly(method_bytes), HELLO_TIMEOUT_S)
        open_frame = sealer.next_open()

        async def read() -> Optional[bytes]:
            sealed = await asyncio.wait_for(reader.readexactly(sealed_size), self.payload_timeout(sealed_size))
            return await run_sized(sealed_size, open_frame, sealed, header + name)

        size = sealed_size - TAG_BYTES
        method = name.decode("utf-8", "replace")
        reply, consumed = await self.servicer.answer(method, size, caller, read)
        if reply is None:
            return False
        sealed_reply = await run_sized(len(reply), sealer.next_seal(), reply, REPLY_HEADER.pack(len(reply) + TAG_BYTES))
        writer.write(REPLY_HEADER.pack(len(sealed_reply)))
        writer.write(sealed_reply)
        await writer.drain()
        self.servicer.meter(method, size if consumed else 0, len(reply))
        if consumed:
            return True
        # answered unread (refused, busy): skip its payload to keep the connection in step, unless it is
        # larger than any request this peer accepts
        if size > self.servicer.max_message_bytes:
            return False
        await _skip(reader, sealed_size, self.payload_timeout(sealed_size))
        return True


async def _skip(reader: asyncio.StreamReader, size: int, timeout: float) -> None:
    """Read and drop ``size`` bytes, a chunk at a time."""

    async def skip() -> None:
        left = size
        while left:
            left -= len(await reader.readexactly(min(left, 2**20)))

    await asyncio.wait_for(skip(), timeout)


# ---- calling ----


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    sealer: Sealer
    idle_since: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        self.writer.close()

    def reusable(self, now: float) -> bool:
        """Whether the server still holds this idle connection open (it closes one idle for IDLE_TIMEOUT_S)."""
        return now - self.idle_since < CLIENT_IDLE_S and not self.reader.at_eof()


@dataclass
class _Channel:
    """What a caller holds for one peer: a session and where the peer's port answered."""

    session_id: bytes
    key: bytes
    host: str
    port: int
    idle: List[_Connection] = field(default_factory=list)

    def close(self) -> None:
        for connection in self.idle:
            connection.close()
        self.idle.clear()


Ask = Callable[[str], Awaitable[Mapping[str, Any]]]


class DirectClient:
    """One process's direct connections to the peers it calls, over one p2pd.

    :meth:`channel` never waits: it returns the channel to a peer once one is open, and otherwise
    starts opening one in the background (the call at hand goes through p2pd meanwhile). ``ask``
    asks a peer for a session through p2pd."""

    def __init__(self, p2p: P2P, ask: Ask):
        self.p2p, self.ask = p2p, ask
        self._channels: Dict[str, _Channel] = {}
        self._retry_at: Dict[str, float] = {}
        self._opening: Dict[str, asyncio.Task] = {}
        self._swept_at = time.monotonic()

    def channel(self, peer_id: str) -> Optional[_Channel]:
        self._sweep()
        channel = self._channels.get(peer_id)
        if channel is None and peer_id not in self._opening and time.monotonic() >= self._retry_at.get(peer_id, 0.0):
            task = asyncio.get_running_loop().create_task(self._open_channel(peer_id))
            self._opening[peer_id] = task
            task.add_done_callback(lambda _: self._opening.pop(peer_id, None))
        return channel

    def _sweep(self) -> None:
        """Close idle connections too old to reuse (every :data:`SWEEP_PERIOD_S` at most), so that peers this
        process no longer calls hold no sockets of it."""
        now = time.monotonic()
        if now - self._swept_at < SWEEP_PERIOD_S:
            return
        self._swept_at = now
        for channel in self._channels.values():
            stale = [c for c in channel.idle if not c.reusable(now)]
            for connection in stale:
                channel.idle.remove(connection)
                connection.close()

    async def _open_channel(self, peer_id: str) -> None:
        try:
            await self._try_open_channel(peer_id)
        except Exception as e:  # never an unretrieved task error: the calls go through p2pd meanwhile
            self._retry_at[peer_id] = time.monotonic() + BROKEN_RETRY_S
            logger.warning(f"opening a direct channel to {peer_id} failed: {type(e).__name__}: {e}")

    async def _try_open_channel(self, peer_id: str) -> None:
        try:
            offer = await self.ask(peer_id)
            session_id, key, port = offer.get("session"), offer.get("key"), offer.get("port")
            if not (
                isinstance(session_id, bytes)
                and len(session_id) == SESSION_ID_BYTES
                and isinstance(key, bytes)
                and len(key) == KEY_BYTES
                and isinstance(port, int)
                and 0 < port < 65536
            ):
                raise ValueError(f"malformed session offer with keys {sorted(offer)[:8]}")
        except Exception as e:  # direct transfers off there, an old peer, a lie: p2pd carries its calls
            self._retry_at[peer_id] = time.monotonic() + UNREACHABLE_RETRY_S
            logger.debug(f"no direct session with {peer_id}: {type(e).__name__}: {e}")
            return
        hosts = await self._hosts(peer_id)
        for host in hosts:
            channel = _Channel(session_id, key, host, port)
            try:
                connection = await asyncio.wait_for(self._connect(channel), CONNECT_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
                logger.debug(f"direct port of {peer_id} at {host}:{port} did not answer: {type(e).__name__}: {e}")
                continue
            channel.idle.append(connection)
            self._channels[peer_id] = channel
            logger.info(f"calls to {peer_id} go straight to {host}:{port}, around p2pd")
            return
        self._retry_at[peer_id] = time.monotonic() + UNREACHABLE_RETRY_S
        logger.info(
            f"peer {peer_id} cannot be reached on its direct port {port} (tried {hosts}); its calls go through p2pd"
        )

    async def _hosts(self, peer_id: str) -> List[str]:
        """Where to try the peer's port: the hosts p2pd is connected to it at, then those it announces."""
        maddrs: List[Multiaddr] = []
        try:
            for info in await asyncio.wait_for(self.p2p.list_peers(), CONNECT_TIMEOUT_S):
                if str(info.peer_id) == peer_id:
                    maddrs.extend(info.addrs)
        except Exception as e:
            logger.debug(f"listing p2pd's connections failed: {type(e).__name__}: {e}")
        maddrs.extend(dialable(address_book.get(peer_id)))
        return [h for h in ip_hosts(str(m) for m in maddrs if not is_circuit(m)) if not is_wildcard(h)]

    @staticmethod
    async def _connect(channel: _Channel) -> _Connection:
        reader, writer = await asyncio.open_connection(channel.host, channel.port)
        try:
            client_salt = os.urandom(SALT_BYTES)
            writer.write(channel.session_id + client_salt)
            server_salt = await reader.readexactly(SALT_BYTES)
        except BaseException:
            writer.close()
            raise
        return _Connection(reader, writer, Sealer(connection_key(channel.key, client_salt, server_salt), sending=0))

    async def _take(self, channel: _Channel) -> _Connection:
        while channel.idle:
            connection = channel.idle.pop()
            if connection.reusable(time.monotonic()):
                return connection
            connection.close()
        return await asyncio.wait_for(self._connect(channel), CONNECT_TIMEOUT_S)

    def _give_back(self, peer_id: str, channel: _Channel, connection: _Connection) -> None:
        if self._channels.get(peer_id) is not channel or len(channel.idle) >= MAX_IDLE_PER_PEER:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        channel.idle.append(connection)

    def forget(self, peer_id: str, retry_after_s: float = BROKEN_RETRY_S) -> None:
        """Drop the channel to ``peer_id`` (its connection broke); open a new one after ``retry_after_s``."""
        channel = self._channels.pop(peer_id, None)
        if channel is not None:
            channel.close()
        self._retry_at[peer_id] = time.monotonic() + retry_after_s

    async def call(self, peer_id: str, channel: _Channel, method: str, payload: bytes, max_reply_bytes: int) -> bytes:
        """Send one request on a connection of ``channel`` and return the reply. Raises :class:`DirectBroken`
        (and forgets the channel) if the connection failed, and :class:`OversizedReply` for a reply announced
        larger than ``max_reply_bytes`` (the peer misbehaved)."""
        name = method.encode("utf-8")
        if len(name) > MAX_METHOD_BYTES:
            raise ValueError(f"method name of {len(name)} bytes exceeds {MAX_METHOD_BYTES} bytes")
        done = False
        try:
            connection = await self._take(channel)
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError) as e:
            self.forget(peer_id)
            raise DirectBroken(f"could not open a direct connection to {peer_id}: {type(e).__name__}: {e}") from None
        try:
            reply = await self._exchange(connection, name, payload, max_reply_bytes)
            done = True
            return reply
        except (OSError, asyncio.IncompleteReadError, InvalidTag) as e:
            self.forget(peer_id)
            raise DirectBroken(f"the direct connection to {peer_id} broke: {type(e).__name__}: {e}") from None
        finally:
            if done:
                self._give_back(peer_id, channel, connection)
                count_rpc_bytes(method_label(method), "sent", len(payload))
                count_rpc_bytes(method_label(method), "received", len(reply))
            else:
                connection.close()  # cancelled or failed mid-call: its frames are out of step

    @staticmethod
    async def _exchange(connection: _Connection, name: bytes, payload: bytes, max_reply_bytes: int) -> bytes:
        header = FRAME_HEADER.pack(len(name), len(payload) + TAG_BYTES) + name
        sealed = await run_sized(len(payload), connection.sealer.next_seal(), payload, header)
        connection.writer.write(header)
        connection.writer.write(sealed)
        sending = asyncio.ensure_future(connection.writer.drain())
        try:
            reply_header = await connection.reader.readexactly(REPLY_HEADER.size)
            (sealed_size,) = REPLY_HEADER.unpack(reply_header)
            if sealed_size > max_reply_bytes + TAG_BYTES or sealed_size < TAG_BYTES:
                raise OversizedReply(f"a direct reply of {sealed_size - TAG_BYTES} bytes (limit {max_reply_bytes})")
            sealed_reply = await connection.reader.readexactly(sealed_size)
            return await run_sized(sealed_size, connection.sealer.next_open(), sealed_reply, reply_header)
        finally:
            if sending.done() and not sending.cancelled():
                sending.exception()  # retrieved: a server that answered unread stops reading
            sending.cancel()


class OversizedReply(ValueError):
    """A direct reply announced larger than the caller accepts."""


_CLIENTS: "weakref.WeakKeyDictionary[P2P, DirectClient]" = weakref.WeakKeyDictionary()


def direct_client_for(p2p: P2P, ask: Ask) -> DirectClient:
    """The direct client of ``p2p`` (one per daemon client, so that every caller of the process shares its
    connections)."""
    client = _CLIENTS.get(p2p)
    if client is None:
        client = _CLIENTS[p2p] = DirectClient(p2p, ask)
    return client
