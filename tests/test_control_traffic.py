"""A live 2+2 swarm at the default announce, expiration, poll and trainer refresh periods: its steps close on
the progress calls the replicas exchange, while each peer stores and reads only a few DHT keys a minute.

The bound comes from the design: a peer stores its record once an announce period (60 s: one key at one
directory level), reads each of the 2 stages once an announce period (2 keys) and probes each stage's levels
every 8 reads (8 minutes; about 14 keys a probe on average). A 40 s window holds at most one store, one read
of each stage and one probe of each: 31 keys, 46.5 a minute; ``MAX_KEYS_PER_MIN`` is 48. Reading the own
stage every poll period instead, as steps once did, is 240 reads a minute. Stage 0 learns when the clock stage
moved on from the trainer's backward calls, so it steps in time with the clock."""

from __future__ import annotations

import time

from tests.test_metrics import free_port, scrape, wait_for_scrape

DEFAULT_PERIODS = ["--announce_period_s", "60", "--expiration_s", "180", "--poll_period_s", "0.25"]
WINDOW_S = 40.0  # seconds the DHT keys are counted over, once the swarm made its first global step
MAX_KEYS_PER_MIN = 48.0
MIN_STEPS = 3  # global steps the clock stage must make within the window (it makes one every second or two)


def _keys(samples) -> float:
    return sum(value for name, value in samples.items() if name.startswith("swarm_dht_keys_total{"))


def test_steps_close_on_progress_calls_with_a_few_dht_keys_a_minute(launcher):
    launcher.bootstrap()
    ports = [free_port() for _ in range(4)]
    extra = [[*DEFAULT_PERIODS, "--metrics_port", str(port)] for port in ports]
    first = [launcher.peer(stage, extra=extra[stage]) for stage in (0, 1)]
    second = [launcher.peer(stage, extra=extra[2 + stage], wait=False) for stage in (0, 1)]
    urls = [peer.wait_event("peer_ready", timeout=5)["metrics"] for peer in first]
    urls += [event["metrics"] for event in launcher.wait_ready(second)]
    launcher.trainer(extra=["--refresh_period_s", "60", "--batch_size", "8"])
    wait_for_scrape(urls[1], lambda s: s["swarm_global_step"] >= 1, 120, "a first global step at the clock stage")

    before, started = [scrape(url) for url in urls], time.monotonic()
    time.sleep(WINDOW_S)
    after, elapsed = [scrape(url) for url in urls], time.monotonic() - started

    per_min = [(_keys(a) - _keys(b)) * 60.0 / elapsed for a, b in zip(after, before)]
    detail = [{name: a[name] - b.get(name, 0) for name in a if name.startswith("swarm_dht_keys_total{")}
              for a, b in zip(after, before)]
    print(f"DHT keys a minute per peer: {[round(x, 1) for x in per_min]}")
    steps = [a["swarm_global_step"] - b["swarm_global_step"] for a, b in zip(after, before)]
    print(f"global steps per peer in the window: {steps}")
    assert max(per_min) <= MAX_KEYS_PER_MIN, f"DHT keys a minute per peer: {per_min}; in the window: {detail}"
    assert steps[1] >= MIN_STEPS, f"the clock stage made {steps[1]} global steps in {elapsed:.0f}s"
    # stage 0 closes each step when the trainer's backward calls say the clock moved on: it keeps pace with the
    # clock, one step of its for one of the clock's, instead of merging several into one
    assert steps[0] >= 0.8 * steps[1], f"stage 0 made {steps[0]} global steps while the clock made {steps[1]}"
    for name, a, b in zip(("s0", "s1", "s0'", "s1'"), after, before):
        received = 'swarm_rpc_bytes_total{direction="received",method="progress"}'
        assert a.get(received, 0) > b.get(received, 0), f"peer {name} heard no progress call in the window"
    # both replicas of each stage applied the same steps: they averaged together, not each alone
    for stage in (0, 1):
        mates = [after[stage]["swarm_global_step"], after[2 + stage]["swarm_global_step"]]
        assert abs(mates[0] - mates[1]) <= 1, f"stage {stage}: replicas at steps {mates}"
