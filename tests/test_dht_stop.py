"""Stopping a DHT process: hivemind's shutdown closes its pipe and, past its grace period, terminates the
process without waiting for it, so a second shutdown while that process exits raises "handle is closed".
``stop_dht`` waits for the exit, kills a process that ignores the terminate, and may be called again."""

from __future__ import annotations

import signal
import time
from functools import partial
from pathlib import Path

import pytest
from hivemind import DHT

from swarm.config.settings import NetworkConfig
from swarm.dht import node as dht_node
from swarm.dht.node import start_dht, stop_dht
from tests.utils.waiting import wait_until


async def _deaf_for(seconds: float, inside: str, _dht: DHT, _node) -> None:
    """Runs in the DHT process: ignore SIGTERM, create the file ``inside``, and hold its event loop for
    ``seconds``."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    Path(inside).touch()
    time.sleep(seconds)


def _deaf_dht(seconds: float, directory: Path) -> DHT:
    inside = directory / "inside_the_call"
    dht = start_dht(NetworkConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"]))
    dht.run_coroutine(partial(_deaf_for, seconds, str(inside)), return_future=True)
    try:
        wait_until(inside.exists, 30, "the DHT process to be inside the call, ignoring SIGTERM")
    except TimeoutError:
        dht.kill()
        dht.join(5)
        raise
    dht.shutdown_timeout = 0.3
    return dht


def test_stop_dht_after_a_shutdown_that_left_the_process_running(tmp_path):
    dht = _deaf_dht(3.0, tmp_path)
    try:
        dht.shutdown()  # the grace period passes and the terminate is ignored: the process still runs
        assert dht.is_alive()
        with pytest.raises(OSError, match="handle is closed"):
            dht.shutdown()
        stop_dht(dht)  # the process reads the shutdown it was sent once its loop is free, and exits
        assert not dht.is_alive()
        stop_dht(dht)
    finally:
        if dht.is_alive():
            dht.kill()
            dht.join(5)


def test_stop_dht_kills_a_process_that_ignores_shutdown_and_terminate(monkeypatch, tmp_path):
    monkeypatch.setattr(dht_node, "DHT_EXIT_WAIT_S", 1.0)
    dht = _deaf_dht(60.0, tmp_path)
    try:
        started = time.monotonic()
        stop_dht(dht)
        assert not dht.is_alive()
        assert dht.exitcode == -signal.SIGKILL
        assert time.monotonic() - started < 10
    finally:
        if dht.is_alive():
            dht.kill()
            dht.join(5)
