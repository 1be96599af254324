"""The reachability check across hosts (network namespaces, addresses from 198.18.0.0/15): a peer on a
host that accepts no incoming connections hears that it is not reachable and serves through the bootstrap
as a relay; a peer on an open host hears that it is reachable.

Host 0 runs the bootstrap; host 2 is open; host 1 listens only on an address no other host has a route to
(:meth:`peers.netns.Hosts.unroutable_address`), so every connection to it fails while its own connections
out work, as behind NAT.
"""

from __future__ import annotations


import pytest

from peers.netns import namespaces_unavailable
from tests.utils.processes import FAST_PEER

pytestmark = pytest.mark.skipif(bool(namespaces_unavailable()), reason=namespaces_unavailable() or "namespaces available")


def test_a_peer_behind_a_closed_host_hears_it_is_unreachable_and_an_open_one_that_it_is_reachable(remote, hosts):
    hidden = hosts.unroutable_address(1)
    bootstrap = remote.start("bootstrap", ["--run_id", remote.run_id, "--num_stages", "1",
                                           "--host_maddrs", f"/ip4/{hosts.address(0)}/tcp/0"],
                             name="bootstrap", prefix=hosts.prefix(0))
    remote.initial_peers = bootstrap.wait_event("bootstrap_ready", timeout=60)["maddrs"]

    def peer(host: int, listen: str, name: str):
        args = ["--stage", "0", *remote.run_args(1, target_batch_size=32), *FAST_PEER, "--host_maddrs", listen]
        return remote.start("peer", args, name=name, prefix=hosts.prefix(host))

    # The open peer comes first: a peer that joined after the closed one would take the stage's state from it,
    # which no host can dial until its relay reservation is made (up to 3 minutes).
    open_peer = peer(2, "/ip4/0.0.0.0/tcp/0", "open-host2")
    opened = open_peer.wait_event("peer_ready", timeout=90)
    closed_peer = peer(1, f"/ip4/{hidden}/tcp/0", "closed-host1")
    closed = closed_peer.wait_event("peer_ready", timeout=90)

    assert opened["reachability"] == "reachable", open_peer.log_tail()
    assert any(hosts.address(2) in m for m in opened["maddrs"]), opened  # 0.0.0.0 announced as its host's address
    assert "reachable from other machines" in open_peer.log_tail(200)
    assert closed["reachability"] == "unreachable", closed_peer.log_tail()
    log = closed_peer.log_tail(200)
    assert "NOT reachable from other machines" in log and "listen on a fixed port" in log, log
    relay = f"/ip4/{hosts.address(0)}/tcp/"
    assert closed["maddrs"] and all(m.startswith(relay) and "/p2p-circuit/p2p/" in m for m in closed["maddrs"]), closed
