"""Which addresses a peer announces and which a caller dials (the live dialing: test_namespaces.py)."""

from __future__ import annotations

from swarm.net.addresses import MAX_MADDRS, announceable, dialable, listens_on_any
from swarm.net.dialing import AddressBook, is_routing_failure
from swarm.dht.records import PeerRecord

PEER = "QmW6TmBSDQUbzWUhycHQXigWZWLYR9mrgrHTxb37X7TYZ7"


def test_announced_addresses_drop_peer_ids_duplicates_and_local_only_hosts_of_a_wildcard_listener():
    visible = [f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER}", f"/ip4/198.18.3.11/tcp/4000/p2p/{PEER}",
               "/ip4/198.18.3.11/tcp/4000", "/ip4/172.17.0.2/tcp/4000", "/ip6/::1/tcp/4000",
               "/ip4/203.0.113.5/udp/4001/quic", "garbage", "/ip4/1.2.3.4"]
    assert announceable(visible, listens_on_any=True) == ["/ip4/198.18.3.11/tcp/4000", "/ip4/203.0.113.5/udp/4001/quic"]
    # a swarm on one machine listens on loopback: its loopback address is the only one there is
    assert announceable([f"/ip4/127.0.0.1/tcp/4000/p2p/{PEER}"], listens_on_any=False) == ["/ip4/127.0.0.1/tcp/4000"]
    many = [f"/ip4/198.18.0.{i}/tcp/4000" for i in range(10)]
    assert announceable(many, listens_on_any=True) == many[:MAX_MADDRS]


def test_wildcard_listeners_are_recognised():
    assert listens_on_any(["/ip4/0.0.0.0/tcp/0"]) and listens_on_any(["/ip6/::/tcp/31337"])
    assert not listens_on_any(["/ip4/127.0.0.1/tcp/0", "/ip4/198.18.0.10/tcp/0"])


def test_only_well_formed_addresses_are_dialed():
    announced = ["/ip4/198.18.0.10/tcp/4000", "/ip4/198.18.0.10", "x" * 500, f"/dns4/example.org/tcp/1/p2p/{PEER}"]
    assert [str(m) for m in dialable(announced)] == ["/ip4/198.18.0.10/tcp/4000", "/dns4/example.org/tcp/1"]
    assert dialable(["/unix/tmp/x"]) == []
    # a record lists at most MAX_MADDRS addresses: a longer list is cut, not dialed in full
    assert len(dialable([f"/ip4/198.18.0.{i}/tcp/4000" for i in range(10)])) == MAX_MADDRS


def test_a_record_carries_its_addresses_and_an_overlong_list_is_refused():
    base = dict(version=1, peer_id=PEER, stage=0, state="online", throughput=1.0, queue_length=0, step=0,
                accum_step=0, samples_pending=0, samples_applied=0)
    record = PeerRecord(**base, maddrs="/ip4/198.18.0.10/tcp/4000,/ip4/203.0.113.5/tcp/4000")
    assert record.addresses == ["/ip4/198.18.0.10/tcp/4000", "/ip4/203.0.113.5/tcp/4000"]
    assert PeerRecord(**base).addresses == []
    try:
        PeerRecord(**base, maddrs=",".join(["/ip4/198.18.0.10/tcp/4000" * 4] * 5))
    except ValueError:
        pass
    else:
        raise AssertionError("an overlong address list must be refused")


def test_the_address_book_keeps_the_last_addresses_a_peer_announced():
    book = AddressBook()
    book.learn({PEER: ["/ip4/198.18.0.10/tcp/4000"]})
    book.learn({PEER: []})  # a record without addresses does not erase what the peer said before
    assert book.get(PEER) == ["/ip4/198.18.0.10/tcp/4000"]
    book.learn({PEER: ["/ip4/198.18.0.11/tcp/4000"]})
    assert book.get(PEER) == ["/ip4/198.18.0.11/tcp/4000"] and book.get("other") == []


def test_routing_failures_are_told_apart_from_failures_of_the_peer():
    assert is_routing_failure(Exception("failed to find peer: routing: not found"))
    assert is_routing_failure(Exception("failed to dial QmX: all dials failed"))
    assert not is_routing_failure(TimeoutError("timed out"))
    assert not is_routing_failure(ConnectionResetError("stream reset"))
