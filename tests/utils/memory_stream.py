"""A binary stream between a caller and an in-process RPCServicer, with no p2pd: what test doubles of P2P
hand to swarm.net.rpc for ``call_binary_stream_handler``."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Callable, List, Optional, Set, Tuple

from swarm.net.rpc import REPLY_HEADER, RPCServicer

Tamper = Callable[[List[bytes]], List[bytes]]


class MemoryWriter:
    """The writing end of an in-memory pipe: whatever is written is fed to ``reader``."""

    def __init__(self, reader: asyncio.StreamReader):
        self.reader, self.closed = reader, False

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.reader.feed_data(bytes(data))

    async def drain(self) -> None:
        await asyncio.sleep(0)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.reader.feed_eof()

    def is_closing(self) -> bool:
        return self.closed

    async def wait_closed(self) -> None:
        return None


class TamperingReplyWriter(MemoryWriter):
    """The server's end: holds the reply until it is whole, passes its payload through ``tamper`` (a list of
    parts in, a list of parts out; an empty list loses the reply, as p2pd now and then does) and sends the
    result framed again."""

    def __init__(self, reader: asyncio.StreamReader, tamper: Tamper):
        super().__init__(reader)
        self.tamper, self.held, self.sent = tamper, b"", False

    def write(self, data: bytes) -> None:
        if self.sent or self.closed:
            return
        self.held += bytes(data)
        if len(self.held) < REPLY_HEADER.size:
            return
        (size,) = REPLY_HEADER.unpack(self.held[:REPLY_HEADER.size])
        if len(self.held) < REPLY_HEADER.size + size:
            return
        self.sent = True
        parts = self.tamper([self.held[REPLY_HEADER.size:]])
        if not parts:
            self.close()
            return
        payload = b"".join(parts)
        super().write(REPLY_HEADER.pack(len(payload)) + payload)


class MemoryStreams:
    """Opens in-memory binary streams to ``servicer`` as ``caller``."""

    def __init__(self, servicer: RPCServicer, caller: str, tamper: Optional[Tamper] = None):
        self.servicer, self.caller = servicer, caller
        self.tamper: Tamper = tamper or (lambda parts: parts)
        self._serving: Set[asyncio.Future] = set()

    async def open(self) -> Tuple[SimpleNamespace, asyncio.StreamReader, MemoryWriter]:
        to_server, to_caller = asyncio.StreamReader(), asyncio.StreamReader()
        info = SimpleNamespace(peer_id=self.caller)
        replies = TamperingReplyWriter(to_caller, self.tamper)
        serving = asyncio.ensure_future(self.servicer.serve_stream(info, to_server, replies))
        self._serving.add(serving)
        serving.add_done_callback(self._serving.discard)
        return info, to_caller, MemoryWriter(to_server)
