"""The announcer stores a record that changed at once near a step, and an unchanged one only once an
announce period: a replica with nothing new to say (standing by, or waiting for its stage-mates) must
not store the same record 20 times a second."""

import asyncio
from types import SimpleNamespace

import swarm.server.announcer as announcer_module
from swarm.server.announcer import Announcer


class _Directory:
    def __init__(self, ok: bool = True):
        self.stored, self.ok = [], ok

    async def store(self, record, expiration_s):
        self.stored.append(record)
        return self.ok


def _peer(directory, announce_period_s=0.3):
    config = SimpleNamespace(announce_period_s=announce_period_s, expiration_s=6.0)
    return SimpleNamespace(peer_id="QmPeer", stage=0, state="online", runner=None, steps=None, queued=0, run_hash="",
                           maddrs=[], config=config, directory=directory)


class _Clock:
    """The announcer's monotonic clock, moved by the test: the announce period passes exactly when the test says,
    however long the machine takes to run it."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def monotonic(self) -> float:
        return self.now


def test_an_unchanged_record_is_stored_again_only_after_the_announce_period(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(announcer_module, "time", clock)

    async def scenario():
        directory = _Directory()
        peer = _peer(directory)
        announcer = Announcer(peer)
        assert await announcer.announce(only_if_changed=True)  # nothing stored yet
        for _ in range(5):
            assert not await announcer.announce(only_if_changed=True)
        assert len(directory.stored) == 1
        peer.queued = 2  # the record changed: stored at once
        assert await announcer.announce(only_if_changed=True)
        assert not await announcer.announce(only_if_changed=True)
        clock.now += 0.29  # still within the announce period (0.3 s) of the last store
        assert not await announcer.announce(only_if_changed=True)
        clock.now += 0.02  # the announce period is up: stored although unchanged (its expiration)
        assert await announcer.announce(only_if_changed=True)
        assert await announcer.announce()  # far from a step: every call stores
        assert len(directory.stored) == 4
    asyncio.run(scenario())


def test_a_failed_store_is_tried_again_at_once():
    async def scenario():
        directory = _Directory(ok=False)
        announcer = Announcer(_peer(directory))
        for _ in range(3):
            assert not await announcer.announce(only_if_changed=True)
        assert len(directory.stored) == 3, "a record no DHT node took was never announced"
    asyncio.run(scenario())
