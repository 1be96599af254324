"""The announcer stores the peer's record once an announce period, whatever changes in between: gradients
accumulated and steps applied travel to stage-mates by progress calls, not by storing the record again."""

import asyncio
from types import SimpleNamespace

from swarm.server.announcer import Announcer


class _Directory:
    def __init__(self, ok: bool = True):
        self.stored, self.ok = [], ok

    async def store(self, record, expiration_s):
        self.stored.append(record)
        return self.ok


class _Peer(SimpleNamespace):
    """A peer whose record changes (its queue grows) while the announcer sleeps; it stops after ``loops`` sleeps."""

    def __init__(self, directory, loops: int):
        super().__init__(peer_id="QmPeer", stage=0, state="online", runner=None, steps=None, queued=0, run_hash="",
                         maddrs=[], config=SimpleNamespace(announce_period_s=30.0, expiration_s=120.0),
                         directory=directory, stopping=asyncio.Event(), sleeps=[], loops=loops)

    async def sleep_or_progress(self, waker, period_s, min_period_s):
        self.sleeps.append((waker, period_s))
        self.queued += 1
        if len(self.sleeps) >= self.loops:
            self.stopping.set()


def test_the_record_is_stored_once_an_announce_period_and_progress_does_not_wake_the_announcer():
    async def scenario():
        directory = _Directory()
        peer = _Peer(directory, loops=3)
        await asyncio.wait_for(Announcer(peer).run(), 5.0)
        assert len(directory.stored) == 3
        assert [record.queue_length for record in directory.stored] == [0, 1, 2]
        assert peer.sleeps == [(None, 30.0)] * 3, "gradients arriving must not wake the announcer"
    asyncio.run(scenario())


def test_a_failed_store_says_so():
    async def scenario():
        directory = _Directory(ok=False)
        announcer = Announcer(_Peer(directory, loops=1))
        assert not await announcer.announce()
        assert announcer.stores == 1 and len(directory.stored) == 1
    asyncio.run(scenario())
