"""The hosts of a benchmark raise the kernel's ARP table limits to what they can need, and put back what they
found: the table is shared by every namespace and by default holds 1,024 entries, fewer than 33 hosts that all
talk to each other use."""

from __future__ import annotations

import pytest

from peers import netns
from peers.netns import Hosts


@pytest.fixture
def limits(tmp_path, monkeypatch):
    for level, value in ((2, 512), (3, 1024)):
        (tmp_path / f"gc_thresh{level}").write_text(f"{value}\n")
    monkeypatch.setattr(netns, "NEIGHBOUR_LIMITS", str(tmp_path / "gc_thresh{}"))
    return lambda level: int((tmp_path / f"gc_thresh{level}").read_text())


def test_many_hosts_raise_the_limits_and_put_back_what_they_found(limits):
    hosts = Hosts(40)
    hosts._make_room_for_neighbours()
    assert (limits(2), limits(3)) == (41 ** 2, 2 * 41 ** 2)
    hosts.close()
    assert (limits(2), limits(3)) == (512, 1024)


def test_few_hosts_leave_the_limits_alone(limits):
    hosts = Hosts(3)
    hosts._make_room_for_neighbours()
    hosts.close()
    assert (limits(2), limits(3)) == (512, 1024)


def test_a_limit_changed_by_someone_else_meanwhile_is_theirs(limits, tmp_path):
    hosts = Hosts(40)
    hosts._make_room_for_neighbours()
    (tmp_path / "gc_thresh3").write_text("9999\n")
    hosts.close()
    assert (limits(2), limits(3)) == (512, 9999)
