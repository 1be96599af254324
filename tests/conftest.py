"""Fixtures that start real swarms on 127.0.0.1 and always stop every process they started."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from peers.netns import Hosts, NamespacesUnavailable
from tests.utils.probe import Probe
from tests.utils.processes import Launcher


LOG_EXCERPT_LINES = 25  # per role: its last lines, plus every warning and error before them (capped)
LOG_WARNINGS = 40


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed live test shows what its roles logged: a stall or a wrong verdict in CI leaves no other trace."""
    outcome = yield
    report = outcome.get_result()
    tmp_path = item.funcargs.get("tmp_path") if hasattr(item, "funcargs") else None
    if report.when == "call" and report.failed and tmp_path is not None:
        for log in sorted(Path(tmp_path).rglob("*.log")):
            report.sections.append((f"role log {log.relative_to(tmp_path)}", _log_excerpt(log)))


def _log_excerpt(log: Path) -> str:
    lines = log.read_text(errors="replace").splitlines()
    head, tail = lines[:-LOG_EXCERPT_LINES], lines[-LOG_EXCERPT_LINES:]
    flagged = [line for line in head if "[WARN" in line or "[ERROR" in line or "Traceback" in line][-LOG_WARNINGS:]
    return "\n".join([*flagged, "...", *tail] if flagged else tail)


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
