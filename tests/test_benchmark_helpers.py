"""Helpers the pipeline benchmark measures with: stopping the swarm's processes while the single process
runs, and combining a phase's windows into one figure."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.utils.benchmark_modules import load_benchmark


def _state(pid: int) -> str:
    raw = Path(f"/proc/{pid}/stat").read_text()
    return raw[raw.rindex(")") + 2]


def _wait_state(pid: int, wanted: str, timeout: float = 5.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = _state(pid)
        if (state == "T") == (wanted == "T"):
            return state
        time.sleep(0.02)
    return _state(pid)


@pytest.fixture
def process_tree():
    """A parent that forked a child, both sleeping; both killed at the end."""
    code = ("import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(child.pid, flush=True); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    child_pid = int(parent.stdout.readline())
    yield parent.pid, child_pid
    for pid in (child_pid, parent.pid):
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    parent.wait(timeout=10)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc (Linux)")
def test_paused_stops_a_whole_tree_and_continues_it_also_on_error(process_tree):
    roles = load_benchmark("_roles")
    parent, child = process_tree
    with roles.paused([parent]) as stopped:
        assert sorted(stopped) == sorted([parent, child])
        assert _wait_state(parent, "T") == "T" and _wait_state(child, "T") == "T"
    assert _wait_state(parent, "S") != "T" and _wait_state(child, "S") != "T"

    with pytest.raises(RuntimeError):
        with roles.paused([parent]):
            assert _wait_state(child, "T") == "T"
            raise RuntimeError("a window failed")
    assert _wait_state(parent, "S") != "T" and _wait_state(child, "S") != "T"


def test_paused_leaves_the_calling_process_running():
    roles = load_benchmark("_roles")
    with roles.paused([os.getpid()]) as stopped:
        assert os.getpid() not in stopped
        assert _state(os.getpid()) != "T"


def test_windows_combine_into_totals_and_weighted_means():
    pipeline = load_benchmark("pipeline")
    window = lambda elapsed, samples, mbs, latency, cpu, before: {  # noqa: E731
        "in_flight": 4, "elapsed_s": elapsed, "samples": samples, "micro_batches": mbs,
        "tokens_per_s": samples * 128 / elapsed, "latency_ms": latency, "calls_ms": {"forward0": latency / 2},
        "failed": 1, "cpu_s": {"peer0 python": cpu, "machine": 2 * cpu}, "single_before": before}
    phase = pipeline.combine_windows([window(2.0, 64, 4, 100.0, 1.0, 0), window(6.0, 64, 12, 200.0, 3.0, 1)])
    assert phase["elapsed_s"] == 8.0 and phase["samples"] == 128 and phase["micro_batches"] == 16
    assert phase["tokens_per_s"] == pytest.approx(128 * 128 / 8.0)  # total tokens over total time, not a mean of rates
    assert phase["latency_ms"] == pytest.approx((4 * 100 + 12 * 200) / 16)
    assert phase["calls_ms"]["forward0"] == pytest.approx((4 * 50 + 12 * 100) / 16)
    assert phase["failed"] == 2
    assert phase["cpu_s_per_micro_batch"]["peer0 python"] == pytest.approx(4.0 / 16)
    assert phase["cores_busy"]["machine"] == pytest.approx(8.0 / 8.0)
    assert [w["single_before"] for w in phase["windows"]] == [0, 1]


def test_a_baseline_pools_its_windows_tokens_over_their_seconds():
    pipeline = load_benchmark("pipeline")
    fast, slow = {"tokens_per_s": 5000.0, "wall_s": 2.0}, {"tokens_per_s": 2500.0, "wall_s": 4.0}
    assert pipeline.pooled_tokens_per_s([fast, slow]) == pytest.approx(20000 / 6.0)
    assert pipeline.pooled_tokens_per_s([fast]) == 5000.0
