"""Fixtures that start real swarms on 127.0.0.1 and always stop every process they started."""

from __future__ import annotations

import uuid

import pytest

from peers.netns import Hosts, NamespacesUnavailable
from tests.utils.probe import Probe
from tests.utils.processes import Launcher


@pytest.fixture
def launcher(tmp_path):
    launcher = Launcher(tmp_path, run_id=f"t{uuid.uuid4().hex[:8]}")
    try:
        yield launcher
    finally:
        launcher.close()


@pytest.fixture
def probe(launcher):
    if not launcher.initial_peers:
        launcher.bootstrap()
    probe = Probe(launcher.initial_peers, launcher.run_id)
    try:
        yield probe
    finally:
        probe.shutdown()


@pytest.fixture
def hosts():
    """Three network namespaces on one bridge (addresses from 198.18.0.0/15), removed at the end."""
    try:
        hosts = Hosts(3).create()
    except NamespacesUnavailable as e:
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        yield hosts
    finally:
        hosts.close()


@pytest.fixture
def remote(tmp_path, hosts):
    """A launcher whose roles run on ``hosts``: it is closed before the namespaces go."""
    launcher = Launcher(tmp_path, run_id=f"t{uuid.uuid4().hex[:8]}")
    try:
        yield launcher
    finally:
        launcher.close()
