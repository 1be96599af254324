"""Direct calls (swarm/net/direct.py): sealed frames, sessions bound to the caller p2pd authenticated, and what
a forged, altered or replayed connection gets (nothing reaches a handler)."""

from __future__ import annotations

import asyncio
import os
from typing import Any, Dict, List

import pytest
import torch
from cryptography.exceptions import InvalidTag
from hivemind.p2p import PeerID
from hivemind.p2p.p2p_daemon_bindings.datastructures import PeerInfo
from hivemind.utils.multiaddr import Multiaddr

from swarm.net.direct import (FRAME_HEADER, SALT_BYTES, SESSION_ID_BYTES, DirectBroken, DirectClient, DirectServer,
                          OversizedReply, Sealer, connection_key, listen_hosts)
from swarm.net.rpc import RPCServicer, payload_timeout
from swarm.net.wire import decode, encode
from tests.utils.waiting import await_until

PEER = "QmdSCT8eDgt5Du6FbMUEWJHpNRDeYGrCsWDX2c6MTiTmW6"  # the server's peer id, as the caller knows it
CALLER = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # the caller's peer id, as p2pd told the server


def test_sealed_frames_open_only_in_order_in_their_direction_and_with_their_header():
    key = connection_key(os.urandom(32), os.urandom(SALT_BYTES), os.urandom(SALT_BYTES))
    client, server = Sealer(key, sending=0), Sealer(key, sending=1)
    first, second = client.next_seal()(b"one", b"h1"), client.next_seal()(b"two", b"h2")
    assert server.next_open()(first, b"h1") == b"one"
    with pytest.raises(InvalidTag):
        server.next_open()(first, b"h1")  # a repeated frame
    other = Sealer(key, sending=1)
    with pytest.raises(InvalidTag):
        other.next_open()(second, b"h2")  # out of order
    with pytest.raises(InvalidTag):
        Sealer(key, sending=1).next_open()(first, b"h0")  # its header altered
    reply = server.next_seal()(b"answer", b"r")
    with pytest.raises(InvalidTag):
        Sealer(key, sending=1).next_open()(reply, b"r")  # a reply reflected as a request
    assert client.next_open()(reply, b"r") == b"answer"


def test_each_pair_of_salts_gives_its_own_key():
    session = os.urandom(32)
    a, b = os.urandom(SALT_BYTES), os.urandom(SALT_BYTES)
    assert connection_key(session, a, b) == connection_key(session, a, b)
    assert len({connection_key(session, a, b), connection_key(session, a, os.urandom(SALT_BYTES)),
                connection_key(os.urandom(32), a, b)}) == 3


def test_listen_hosts_keeps_ip_hosts_once_and_a_wildcard_alone():
    assert listen_hosts(["/ip4/127.0.0.1/tcp/0", "/ip4/127.0.0.1/udp/0/quic"]) == ["127.0.0.1"]
    assert listen_hosts(["/ip4/198.18.0.2/tcp/0", "/ip6/::1/tcp/0"]) == ["198.18.0.2", "::1"]
    assert listen_hosts(["/ip4/10.0.0.2/tcp/1", "/ip4/0.0.0.0/tcp/2"]) == ["0.0.0.0"]
    assert listen_hosts(["/dns4/example.org/tcp/1", "garbage"]) == []


class _P2P:
    """What a direct client asks of its p2pd: the addresses of its connections."""

    def __init__(self, host: str = "127.0.0.1"):
        self.host = host

    async def list_peers(self) -> List[PeerInfo]:
        return [PeerInfo(PeerID.from_base58(PEER), [Multiaddr(f"/ip4/{self.host}/tcp/4001")])]


class _Served:
    """A servicer with one handler that records who called it, behind a direct server."""

    def __init__(self, authorize=None, max_message_bytes: int = 2**20):
        self.callers: List[str] = []

        async def echo(message: Dict[str, Any], caller: str) -> Dict[str, Any]:
            self.callers.append(caller)
            return {"doubled": message["x"] * 2}

        self.servicer = RPCServicer({"echo": echo}, max_message_bytes=max_message_bytes, authorize=authorize)
        self.server = DirectServer(self.servicer, ["127.0.0.1"], 0, payload_timeout)

    async def __aenter__(self) -> "_Served":
        await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def client(self, p2p: _P2P = None) -> DirectClient:
        async def ask(peer_id: str) -> Dict[str, Any]:
            assert peer_id == PEER
            return await self.server.session({}, CALLER)  # what the p2pd call would return

        client = DirectClient(p2p or _P2P(), ask)
        assert client.channel(PEER) is None  # opened in the background
        await await_until(lambda: client.channel(PEER), 10, "the direct channel to open")
        return client


def _request(values: List[float]) -> bytes:
    return encode({"x": torch.tensor(values)})


async def test_a_call_reaches_the_handler_as_the_session_caller_and_the_connection_is_reused():
    async with _Served() as served:
        client = await served.client()
        channel = client.channel(PEER)
        assert channel is not None and channel.port == served.server.port
        for values in ([1.0, 2.0], [3.0]):
            reply = decode(await client.call(PEER, channel, "echo", _request(values), 2**20))
            assert reply["doubled"].tolist() == [2 * v for v in values]
        assert served.callers == [CALLER, CALLER]
        assert len(channel.idle) == 1  # one connection carried both calls
        reply = decode(await client.call(PEER, channel, "nope", _request([1.0]), 2**20))
        assert reply["kind"] == "bad_request"  # the servicer's own errors come back as replies


async def test_an_unauthorized_caller_is_refused_on_the_direct_port_too():
    async with _Served(authorize=lambda caller: caller != CALLER) as served:
        client = await served.client()
        channel = client.channel(PEER)
        for _ in range(2):
            reply = decode(await client.call(PEER, channel, "echo", _request([1.0] * 1000), 2**20))
            assert reply["kind"] == "unauthorized" and served.callers == []
        assert len(channel.idle) == 1  # a request answered unread was skipped: the connection stays in step


async def test_a_connection_cancelled_at_shutdown_ends_without_an_unhandled_error():
    loop = asyncio.get_running_loop()
    reported: List[Dict[str, Any]] = []
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: reported.append(context))
    try:
        async with _Served() as served:
            reader, writer = await asyncio.open_connection("127.0.0.1", served.server.port)
            await await_until(lambda: served.server._writers, 10, "the server to take the connection")
            serving = [task for task in asyncio.all_tasks() if "_serve" in repr(task.get_coro())]
            assert serving, "the connection's serving task"
            for task in serving:
                task.cancel()  # what the loop does to its tasks when the peer shuts down
            # the tasks' done callbacks (asyncio's stream callback among them) run before asyncio.wait returns
            _, pending = await asyncio.wait(serving, timeout=10)
            assert not pending, "the cancelled serving tasks to end"
            writer.close()
        assert reported == [], reported
    finally:
        loop.set_exception_handler(previous)


async def test_a_caller_holds_one_session_at_a_time():
    async with _Served() as served:
        first = await served.server.session({}, CALLER)
        second = await served.server.session({}, CALLER)
        await served.server.session({}, PEER)
        assert set(served.server._sessions) == {second["session"], served.server._session_of[PEER]}
        assert first["session"] not in served.server._sessions


async def test_idle_connections_too_old_to_reuse_are_closed():
    async with _Served() as served:
        client = await served.client()
        channel = client.channel(PEER)
        connection = channel.idle[0]
        connection.idle_since -= 3600
        client._swept_at -= 3600
        assert client.channel(PEER) is channel and channel.idle == []
        assert connection.writer.is_closing()


async def test_an_oversized_request_is_refused_unread_and_the_next_call_opens_a_new_connection():
    async with _Served(max_message_bytes=4096) as served:
        client = await served.client()
        channel = client.channel(PEER)
        reply = decode(await client.call(PEER, channel, "echo", _request([0.5] * 4096), 2**20))
        assert reply["kind"] == "bad_request" and "exceeds" in reply["error"] and served.callers == []
        # the server closed the connection it could not skip the request on; the client notices at its next read
        await await_until(lambda: channel.idle and channel.idle[0].reader.at_eof(), 10,
                          "the refused connection's close to reach the client")
        reply = decode(await client.call(PEER, client.channel(PEER), "echo", _request([1.0]), 2**20))
        assert reply["doubled"].tolist() == [2.0] and served.callers == [CALLER]


async def test_a_reply_larger_than_the_caller_accepts_is_refused():
    async with _Served() as served:
        client = await served.client()
        with pytest.raises(OversizedReply):
            await client.call(PEER, client.channel(PEER), "echo", _request([1.0] * 1000), 100)


async def test_a_forgotten_session_breaks_the_call_so_that_it_goes_through_p2pd():
    async with _Served() as served:
        client = await served.client()
        channel = client.channel(PEER)
        served.server._sessions.clear()  # as after a restart of the peer under the same identity
        channel.close()  # no idle connection: the next call opens one with the forgotten session
        with pytest.raises(DirectBroken):
            await client.call(PEER, channel, "echo", _request([1.0]), 2**20)
        assert client.channel(PEER) is None and served.callers == []  # forgotten until the retry time


async def test_a_closed_port_leaves_the_peer_to_p2pd():
    async with _Served() as served:
        port = served.server.port
    async def ask(peer_id: str) -> Dict[str, Any]:
        return {"session": os.urandom(SESSION_ID_BYTES), "key": os.urandom(32), "port": port}

    client = DirectClient(_P2P(), ask)
    assert client.channel(PEER) is None
    await await_until(lambda: PEER in client._retry_at and PEER not in client._opening, 10,
                      "the attempt at the closed port to end")
    assert client.channel(PEER) is None and PEER in client._retry_at


@pytest.mark.parametrize("offer", [{}, {"session": b"x", "key": os.urandom(32), "port": 1},
                                   {"session": os.urandom(16), "key": os.urandom(32), "port": 70000}])
async def test_a_malformed_session_offer_is_not_used(offer):
    async def ask(peer_id: str) -> Dict[str, Any]:
        return offer

    client = DirectClient(_P2P(), ask)
    client.channel(PEER)
    await await_until(lambda: PEER in client._retry_at and PEER not in client._opening, 10,
                      "the malformed offer to be turned down")
    assert client.channel(PEER) is None and PEER in client._retry_at


async def _relay(port: int, alter_at: int, recorded: List[bytes]) -> asyncio.AbstractServer:
    """A man in the middle: forwards a connection to ``port``, records what the caller sent, and flips the
    byte at offset ``alter_at`` of it (-1: none)."""
    async def handle(reader, writer):
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        sent = bytearray()

        async def upstream():
            while data := await reader.read(65536):
                start = len(sent)
                sent.extend(data)
                data = bytearray(data)
                if start <= alter_at < len(sent):
                    data[alter_at - start] ^= 0x01
                up_writer.write(bytes(data))
            recorded.append(bytes(sent))
            up_writer.close()

        async def downstream():
            while data := await up_reader.read(65536):
                writer.write(data)
            writer.close()

        await asyncio.gather(upstream(), downstream(), return_exceptions=True)

    return await asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("where", ["method", "payload"])
async def test_a_frame_altered_on_the_path_reaches_no_handler(where):
    async with _Served() as served:
        offset = SESSION_ID_BYTES + SALT_BYTES + FRAME_HEADER.size + (1 if where == "method" else 20)
        relay = await _relay(served.server.port, offset, [])
        client = await served.client()
        channel = client.channel(PEER)
        channel.close()
        channel.port = relay.sockets[0].getsockname()[1]
        with pytest.raises(DirectBroken):
            await client.call(PEER, channel, "echo", _request([1.0, 2.0]), 2**20)
        relay.close()
        assert served.callers == []


async def test_a_recorded_connection_replayed_reaches_no_handler():
    async with _Served() as served:
        recorded: List[bytes] = []
        relay = await _relay(served.server.port, -1, recorded)
        client = await served.client()
        channel = client.channel(PEER)
        channel.close()
        channel.port = relay.sockets[0].getsockname()[1]
        await client.call(PEER, channel, "echo", _request([1.0]), 2**20)
        channel.close()  # ends the recorded connection
        await await_until(lambda: recorded, 10, "the relay to record the connection")
        relay.close()
        assert served.callers == [CALLER] and recorded
        reader, writer = await asyncio.open_connection("127.0.0.1", served.server.port)
        writer.write(recorded[0])  # same session, same client salt, same frames: the server's salt is new
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)  # until the server closes the connection
        assert len(answer) == SALT_BYTES  # its new salt, and no reply
        writer.close()
        assert served.callers == [CALLER]


def test_live_stage_calls_go_direct_where_the_port_is_open_and_through_p2pd_where_it_is_off(launcher):
    launcher.bootstrap()
    peers = [launcher.peer(0, wait=False), launcher.peer(1, extra=["--direct_port", "-1"], wait=False)]
    direct_id, p2pd_id = (event["peer_id"] for event in launcher.wait_ready(peers))
    trainer = launcher.trainer(extra=["--max_samples", "64", "--batch_size", "8"])
    assert trainer.wait_event("trainer_done", timeout=120)["samples_sent"] == 64
    straight = [line for line in trainer.log_path.read_text().splitlines() if "go straight to" in line]
    assert len(straight) == 1 and f"calls to {direct_id} go straight to 127.0.0.1:" in straight[0], straight
    assert "direct calls: listening on 127.0.0.1 port" in peers[0].log_tail(400)
    assert "direct calls" not in peers[1].log_tail(400) and p2pd_id not in straight[0]
