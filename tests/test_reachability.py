"""The reachability check: what a peer is told from a helper's dial-back report (pure), the reply's checks,
relay addresses as p2pd reads them, port 0 in announced addresses, what a wildcard listener announces, and
one dial-back on loopback."""

from __future__ import annotations

import pytest
from hivemind.p2p import P2P, PeerID

from swarm.config.settings import NetworkConfig
from swarm.net.listening import resolve_ports, wildcard_announcements
from swarm.net.addresses import circuit_maddr, dialable
from swarm.net.reachability import (
    DialBackReport, check_reachability, decide, dial_back, needs_check, parse_report, relay_addresses, relayed_options,
)

RELAY_ID = "12D3KooWEy7UYUy8tdQpq4oEYWF96DL6GPuyeZQ9wDDGBPZT5975"
PUBLIC = "/ip4/203.0.113.7/tcp/31337"
LAN = "/ip4/192.168.1.20/tcp/31337"
ANY = ["/ip4/0.0.0.0/tcp/31337"]


def test_a_peer_on_loopback_is_not_checked_and_told_how_to_serve_others():
    verdict = decide(["/ip4/127.0.0.1/tcp/4000"], ["/ip4/127.0.0.1/tcp/0"], None)
    assert verdict.status == "local" and not verdict.use_relay
    assert "--host_maddrs /ip4/0.0.0.0/tcp/PORT" in verdict.message
    assert not needs_check(["/ip4/127.0.0.1/tcp/0", "/ip6/::1/tcp/0"]) and needs_check(ANY)


def test_an_address_the_helper_reached_makes_the_peer_reachable():
    report = DialBackReport("helper", reachable=(PUBLIC,), failed={LAN: "no route to host"})
    verdict = decide([PUBLIC, LAN], ANY, report)
    assert verdict.status == "reachable" and not verdict.use_relay and verdict.addresses == (PUBLIC,)
    assert PUBLIC in verdict.message and f"not at {LAN}" in verdict.message


def test_no_address_reached_means_unreachable_with_the_port_to_open_and_a_relay():
    report = DialBackReport("helper", failed={LAN: "dial tcp4 192.168.1.20:31337: i/o timeout"})
    verdict = decide([LAN], ANY, report)
    assert verdict.status == "unreachable" and verdict.use_relay and verdict.ports_to_open == (31337,)
    assert "NOT reachable" in verdict.message and "i/o timeout" in verdict.message
    assert "open TCP port 31337" in verdict.message and "--announce_maddrs /ip4/<your public IP>/tcp/31337" in verdict.message


def test_a_random_port_cannot_be_opened_so_the_user_is_told_to_fix_one():
    verdict = decide(["/ip4/192.168.1.20/tcp/41234"], ["/ip4/0.0.0.0/tcp/0"], DialBackReport("helper"))
    assert verdict.status == "unreachable" and verdict.ports_to_open == (41234,)  # the port it was given this time
    assert "listen on a fixed port" in verdict.message and "got port 41234, a new one at every start" in verdict.message
    nothing = decide([], ["/ip4/0.0.0.0/tcp/0"], None)
    assert nothing.status == "unreachable" and nothing.use_relay and nothing.ports_to_open == ()
    assert "no address others could dial" in nothing.message and "--host_maddrs /ip4/0.0.0.0/tcp/PORT" in nothing.message


def test_no_helper_answering_is_unknown_not_unreachable():
    verdict = decide([PUBLIC], ANY, None, "helper: TimeoutError")
    assert verdict.status == "unknown" and not verdict.use_relay and "TimeoutError" in verdict.message


def test_a_reply_counts_only_the_addresses_asked_about():
    report = parse_report("h", {"reachable": [PUBLIC, "/ip4/6.6.6.6/tcp/1"], "failed": {LAN: "x" * 1000}}, [PUBLIC, LAN])
    assert report.reachable == (PUBLIC,) and len(report.failed[LAN]) == 200
    for bad in ({}, {"reachable": "all", "failed": {}}, {"reachable": [], "failed": []}):
        with pytest.raises(ValueError):
            parse_report("h", bad, [PUBLIC])


def test_relay_addresses_are_encoded_as_p2pd_reads_them():
    relays = relay_addresses([f"/ip4/198.18.0.10/tcp/31000/p2p/{RELAY_ID}", f"/ip4/127.0.0.1/tcp/1/p2p/{RELAY_ID}",
                              "/ip4/198.18.0.11/tcp/31000"])
    assert relays == [f"/ip4/198.18.0.10/tcp/31000/p2p/{RELAY_ID}/p2p-circuit"]  # no loopback, no relay without an id
    encoded = circuit_maddr("/ip4/198.18.0.10/tcp/31000", RELAY_ID).to_bytes()
    peer_id = PeerID.from_base58(RELAY_ID).to_bytes()
    assert encoded.endswith(bytes([0xA5, 0x03, len(peer_id)]) + peer_id + bytes([0xA2, 0x02]))  # multihash, not CID
    assert dialable(relays)[0].to_bytes() == encoded
    assert relayed_options(["/ip4/198.18.0.10/tcp/31000/p2p/x"])["force_reachability"] == "private"


def test_port_zero_in_announced_addresses_becomes_the_listening_port():
    assert resolve_ports(["/ip4/0.0.0.0/tcp/0"], [], lambda m: 5555) == (["/ip4/0.0.0.0/tcp/0"], [])
    host, announce = resolve_ports(["/ip4/0.0.0.0/tcp/0"], ["/ip4/203.0.113.7/tcp/0"], lambda m: 5555)
    assert host == ["/ip4/0.0.0.0/tcp/5555"] and announce == ["/ip4/203.0.113.7/tcp/5555"]
    host, announce = resolve_ports(["/ip4/0.0.0.0/tcp/4444"], ["/ip4/203.0.113.7/tcp/0", PUBLIC], lambda m: 5555)
    assert host == ["/ip4/0.0.0.0/tcp/4444"] and announce == ["/ip4/203.0.113.7/tcp/4444", PUBLIC]
    with pytest.raises(ValueError, match="name the port to announce"):
        resolve_ports(["/ip4/0.0.0.0/tcp/1", "/ip4/0.0.0.0/tcp/2"], ["/ip4/203.0.113.7/tcp/0"])
    with pytest.raises(ValueError, match="name the port to announce"):  # refused with the settings, before any start
        NetworkConfig(host_maddrs=["/ip4/0.0.0.0/tcp/0", "/ip6/::/tcp/0"], announce_maddrs=["/ip4/203.0.113.7/tcp/0"])
    assert NetworkConfig(host_maddrs=["/ip4/0.0.0.0/tcp/0"], announce_maddrs=["/ip4/203.0.113.7/tcp/0"])


def test_a_wildcard_listener_announces_its_interfaces_but_loopback_and_container_bridges():
    interfaces = ["127.0.0.1", "172.17.0.1", "192.168.1.20", "198.18.0.5"]
    assert wildcard_announcements(["/ip4/0.0.0.0/tcp/7000", "/ip4/10.0.0.1/tcp/7001"], interfaces) == \
        ["/ip4/192.168.1.20/tcp/7000", "/ip4/198.18.0.5/tcp/7000", "/ip4/10.0.0.1/tcp/7001"]
    assert wildcard_announcements(["/ip4/0.0.0.0/tcp/7000"], ["127.0.0.1", "172.17.0.2"]) == []  # p2pd decides
    assert wildcard_announcements(["/ip4/0.0.0.0/tcp/7000", "/ip6/::/tcp/7000"], interfaces) == []
    assert wildcard_announcements(["/ip4/127.0.0.1/tcp/7000"], interfaces) == []


async def test_a_helper_dials_back_on_loopback_and_reports_what_it_could_not_reach():
    target = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    try:
        port = [m for m in await target.get_visible_maddrs()][0].value_for_protocol("tcp")
        listening, closed = f"/ip4/127.0.0.1/tcp/{port}", "/ip4/127.0.0.1/tcp/1"
        reply = await dial_back(str(target.peer_id), [closed, listening], dial_timeout_s=5.0)
        assert reply == {"reachable": [listening], "failed": {}}, reply  # the address its connection took
        reply = await dial_back(str(target.peer_id), [closed, "/ip4/127.0.0.1/tcp/2/p2p-circuit"], dial_timeout_s=5.0)
        assert not reply["reachable"] and "connection refused" in reply["failed"][closed], reply
        report, error = await check_reachability(target, [], [listening])
        assert report is None and "no peer of the run to ask" in error
    finally:
        await target.shutdown()
