"""A live peer under random and mutated input while a trainer keeps training.

One peer per stage of a 2-stage tiny-model run (``--max_message_mb 1``), one trainer with
``--max_samples``; the test process fuzzes both peers for ~20 s (tests/utils/fuzzing.py) and
writes junk under the run's DHT keys. Every request must get an error reply (or a well-formed
reply to a well-formed request), both peers must stay alive with no traceback in their logs
and bounded memory, and the trainer must finish its samples.
"""

from __future__ import annotations

import pytest

import asyncio
import random
import time

from tests.utils.fuzzing import FuzzInputs, FuzzStats, fuzz, log_tracebacks, rss_mb, store_junk

FUZZ_S = 20.0
RATE_PER_S = 40.0  # requests/s: enough to cover every family many times, little enough to leave the trainer cores
MAX_SAMPLES = 160
MAX_MESSAGE_MB = 1
# A peer holds at most max_concurrent (8) fuzz requests of <= 4 MiB read each (the drain limit of
# an oversized stream) plus their decoded copies: well under 100 MiB. Training itself, the 1 MB
# junk records the peer reads from the DHT and allocator slack add some tens of MiB; growth
# beyond this bound means the peer keeps what hostile input gave it.
RSS_GROWTH_BOUND_MB = 250.0


async def _watch(peers, stop: asyncio.Event, rss: dict, dht, run_id: str, junk: dict) -> None:
    """Sample the peers' RSS every 0.5 s and store DHT junk every 5 s until ``stop``."""
    rng, next_junk = random.Random(7), 0.0
    while not stop.is_set():
        for process in peers:
            rss[process.name] = max(rss.get(process.name, 0.0), rss_mb(process.pid))
        if time.monotonic() >= next_junk:
            for outcome, count in (await store_junk(dht, run_id, rng)).items():
                junk[outcome] = junk.get(outcome, 0) + count
            next_junk = time.monotonic() + 5.0
        try:
            await asyncio.wait_for(stop.wait(), timeout=0.5)
        except asyncio.TimeoutError:
            pass


@pytest.mark.long
async def test_live_peers_survive_fuzzing_while_training(launcher, probe):
    peers = [launcher.peer(stage, extra=["--max_message_mb", str(MAX_MESSAGE_MB)], wait=False, name=f"stage{stage}")
             for stage in (0, 1)]
    ids = {stage: (await asyncio.to_thread(process.wait_event, "peer_ready", 90))["peer_id"]
           for stage, process in enumerate(peers)}
    trainer = launcher.trainer(extra=["--max_samples", str(MAX_SAMPLES), "--batch_size", "8", "--max_in_flight", "4"])
    await asyncio.to_thread(trainer.wait_event, "trainer_ready", 60)
    await probe.call(ids[0], "info", {})  # starts the probe's P2P before the clock runs
    rss_before = {process.name: rss_mb(process.pid) for process in peers}

    stop, rss, junk = asyncio.Event(), {}, {}
    watcher = asyncio.create_task(_watch(peers, stop, rss, probe.dht, launcher.run_id, junk))
    try:
        stats = await fuzz(probe._p2p, ids, FuzzInputs(seed=3, max_message_bytes=MAX_MESSAGE_MB * 2**20),
                           duration_s=FUZZ_S, rate_per_s=RATE_PER_S, timeout_s=20.0, stats=FuzzStats())
    finally:
        stop.set()
        await watcher

    summary = {**stats.summary(), "junk": dict(junk), "rss_before_mb": rss_before, "rss_max_mb": rss}
    print(summary)
    assert stats.unexpected == 0, f"{summary}\n" + "\n".join(stats.notes)
    assert stats.requests >= 0.25 * FUZZ_S * RATE_PER_S, summary  # the pace is a ceiling; a loaded machine answers slower
    assert len(stats.families) == len(FuzzInputs(0).families), summary  # every family was sent
    assert stats.answered_with_error > 0.6 * stats.requests and stats.outcomes["ok"] > 0, summary
    assert sum(junk.values()) > 0, junk  # stores were attempted; the DHT may refuse some

    done = await asyncio.to_thread(trainer.wait_event, "trainer_done", 90)
    assert done["samples_sent"] == MAX_SAMPLES, done
    for process in peers:
        assert process.proc.poll() is None, f"{process.name} died under fuzzing:\n{process.log_tail()}"
        assert log_tracebacks([process.log_path]) == 0, f"{process.name} logged a traceback:\n{process.log_tail(80)}"
        growth = rss[process.name] - rss_before[process.name]
        assert growth < RSS_GROWTH_BOUND_MB, f"{process.name} RSS grew {growth:.0f} MiB ({rss_before} -> {rss})"
    await probe.call(ids[0], "info", {})  # still serving
