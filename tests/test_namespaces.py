"""A swarm across three hosts (network namespaces on a bridge, addresses from 198.18.0.0/15).

libp2p's own routing keeps no addresses of this range, so every call, averaging round and state
download between hosts works only if peers announce their addresses and callers dial them. Every
role listens on its host's address, never loopback: host 0 runs the bootstrap and the trainer; hosts 1
and 2 each run a replica of the run's one stage, the second joining mid-run, so that trainer calls,
the state download and the averaging all cross hosts.
"""

from __future__ import annotations

import asyncio
import re
import signal

import pytest

from peers.netns import Hosts, namespaces_unavailable
from tests.utils.probe import Probe, online
from tests.utils.processes import FAST_PEER, Launcher, wait_for_log_lines

TARGET = 32
STAGES = 1  # one stage keeps the test small: its replicas on two hosts are what crosses hosts

pytestmark = pytest.mark.skipif(bool(namespaces_unavailable()), reason=namespaces_unavailable() or "namespaces available")


def _listen(hosts: Hosts, host: int):
    return ["--host_maddrs", f"/ip4/{hosts.address(host)}/tcp/0"]


def _peer(launcher: Launcher, hosts: Hosts, host: int, name: str):
    args = ["--stage", "0", *launcher.run_args(STAGES, target_batch_size=TARGET), *FAST_PEER, *_listen(hosts, host)]
    return launcher.start("peer", args, name=name, prefix=hosts.prefix(host))


@pytest.mark.long
async def test_a_swarm_trains_across_hosts_on_a_benchmark_range(remote, hosts):
    bootstrap = remote.start("bootstrap", ["--run_id", remote.run_id, "--num_stages", str(STAGES), *_listen(hosts, 0)],
                             name="bootstrap", prefix=hosts.prefix(0))
    remote.initial_peers = bootstrap.wait_event("bootstrap_ready", timeout=60)["maddrs"]
    assert remote.initial_peers and all(hosts.subnet in m for m in remote.initial_peers), remote.initial_peers
    _peer(remote, hosts, 1, "replica-host1").wait_event("peer_ready", timeout=90)
    probe = Probe(remote.initial_peers, remote.run_id, num_stages=STAGES, host_maddrs=[f"/ip4/{hosts.root_address}/tcp/0"])
    try:
        trainer = remote.start("train", [*remote.run_args(STAGES, target_batch_size=TARGET), "--max_data_mb", "2",
                                         "--refresh_period_s", "0.5", "--log_period_s", "1", "--duration_s", "150",
                                         "--max_in_flight", "2", *_listen(hosts, 0)],
                               name="trainer-host0", prefix=hosts.prefix(0))
        trainer.wait_event("trainer_ready", timeout=90)
        await probe.wait_for(lambda r: any(x.step >= 2 for x in online(r, 0)), 90, "the stage at step 2")
        joiner = _peer(remote, hosts, 2, "replica-host2")
        joiner_id = joiner.wait_event("peer_ready", timeout=90)["peer_id"]
        joined = await probe.wait_for(lambda r: joiner_id in r and r[joiner_id].state == "online", 30, "the joiner online")
        join_step = joined[joiner_id].step
        await probe.wait_for(lambda r: len(online(r, 0)) == 2 and min(x.step for x in online(r, 0)) >= join_step + 3,
                             120, "the stage three steps past the join, on both hosts")
        # while the trainer still trains: the joiner can be three steps past the join by a download alone
        averaged = lambda line: bool(re.search(r"global step \d+ with \d+ samples from 2 replicas", line))
        await asyncio.get_running_loop().run_in_executor(
            None, wait_for_log_lines, joiner, averaged, 60, "global step averaged with the replica on the other host")
        trainer.signal(signal.SIGTERM)
        done = trainer.wait_event("trainer_done", timeout=60)

        def settled(r) -> bool:
            replicas = online(r, 0)
            return (len(replicas) == 2 and len({(x.step, x.digest) for x in replicas}) == 1
                    and not any(x.samples_frozen for x in replicas))

        records = await probe.wait_for(settled, 60, "the replicas to agree")
    finally:
        probe.shutdown()

    assert done["samples_sent"] >= 3 * TARGET and done["drained"], done
    for record in records.values():  # each peer announces its own host's address, and never loopback
        assert record.addresses and all(hosts.subnet in m and "127.0.0.1" not in m for m in record.addresses), record
    assert join_step >= 2, "the joiner must have downloaded the stage's state from the other host"

