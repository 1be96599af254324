"""Every CLI role starts as a subprocess and stops cleanly, leaving no process behind."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys

import pytest

from tests.utils.probe import online
from tests.utils.processes import REPO, TINY_MODEL, RoleProcess, wait_for_log_lines
from tests.utils.waiting import await_until, wait_until

# a trainer's progress line once it has sent samples (it logs one every --log_period_s)
SENT_SOME = re.compile(r"\bsamples +[1-9][0-9]* +loss ")
DRAIN_WINDOW_S = 3.0  # a trainer that leaves without draining is gone well within this after SIGTERM


def _group_exists(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except ProcessLookupError:
        return False
    return True


def group_is_empty(pid: int, timeout: float = 10.0) -> bool:
    """True once no process of the role's process group (p2pd daemons included) is left."""
    try:
        wait_until(lambda: not _group_exists(pid), timeout, f"process group {pid} to end")
    except TimeoutError:
        return False
    return True


def wait_until_sent_some(trainer: RoleProcess, timeout: float = 60.0) -> None:
    """Until the trainer's log says it sent samples: what a test that stops it and counts them needs."""
    wait_for_log_lines(trainer, SENT_SOME.search, timeout, "progress line with samples sent")


def test_help_and_unknown_command():
    result = subprocess.run([sys.executable, "-m", "peers.cli", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0
    for command in ("peer", "train", "bootstrap", "demo", "status", "dashboard", "plan", "simulate"):
        assert command in result.stdout
    result = subprocess.run([sys.executable, "-m", "peers.cli", "fly"], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 2 and "unknown command" in result.stderr


def test_bootstrap_and_peer_stop_cleanly_on_sigterm(launcher):
    boot = launcher.bootstrap()
    peer = launcher.peer(0)
    peer.signal(signal.SIGTERM)
    assert peer.proc.wait(timeout=30) == 0
    assert peer.wait_event("peer_stopped", timeout=5)["peer_id"]
    assert group_is_empty(peer.pid), "the peer left processes behind"
    boot.signal(signal.SIGTERM)
    assert boot.proc.wait(timeout=30) == 0
    assert group_is_empty(boot.pid), "the bootstrap left processes behind"


@pytest.mark.long
def test_ctrl_c_stops_a_peer_and_a_bootstrap_without_a_traceback(launcher):
    """Ctrl-C in a terminal sends SIGINT to the whole process group: the role, its hivemind processes, p2pd."""
    boot = launcher.bootstrap()
    peer = launcher.peer(0)
    os.killpg(peer.pid, signal.SIGINT)
    assert peer.proc.wait(timeout=30) == 0, "the peer ignored SIGINT"
    assert peer.wait_event("peer_stopped", timeout=5)["peer_id"]
    assert group_is_empty(peer.pid), "the peer left processes behind"
    os.killpg(boot.pid, signal.SIGINT)
    assert boot.proc.wait(timeout=30) == 0, "the bootstrap did not exit after SIGINT"
    assert group_is_empty(boot.pid), "the bootstrap left processes behind"
    for role in (peer, boot):
        log = role.log_path.read_text(errors="replace")
        assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-2000:]


@pytest.mark.long
def test_trainer_finishes_and_stops_on_sigterm(launcher):
    launcher.bootstrap()
    launcher.peer(0)
    launcher.peer(1)
    finite = launcher.trainer(extra=["--max_samples", "32"])
    assert finite.proc.wait(timeout=120) == 0
    assert finite.wait_event("trainer_done", timeout=5)["samples_sent"] == 32
    assert group_is_empty(finite.pid)
    status = launcher.start("status", ["--run_id", launcher.run_id, "--initial_peers", ",".join(launcher.initial_peers),
                                       "--count", "1", "--period_s", "1"])
    assert status.proc.wait(timeout=60) == 0
    line = "".join(status.stdout_lines)
    assert "1 trainers" in line and "s0:" in line and "s1:" in line, line
    assert group_is_empty(status.pid)
    endless = launcher.trainer()
    endless.wait_event("trainer_ready", timeout=60)
    wait_until_sent_some(endless)
    endless.signal(signal.SIGTERM)
    assert endless.proc.wait(timeout=60) == 0
    assert endless.wait_event("trainer_done", timeout=5)["samples_sent"] > 0
    assert group_is_empty(endless.pid)


@pytest.mark.long
async def test_a_second_sigterm_cuts_a_trainers_drain_short(launcher, probe):
    """A stopping trainer waits for live replicas to hold what it sent; with every replica gone it would wait
    its whole bound, so a second SIGTERM (or Ctrl-C) leaves at once."""
    # the probe fixture started the run's bootstrap
    peers = [launcher.peer(stage, target_batch_size=100_000) for stage in (0, 1)]  # no step ever commits a sample
    trainer = launcher.trainer(target_batch_size=100_000, extra=["--peer_grace_s", "1"])
    trainer.wait_event("trainer_ready", timeout=60)
    wait_until_sent_some(trainer)
    for peer in peers:
        peer.kill_group()
    # their records expire (3 s): every reader of the DHT, the trainer too, sees its samples held nowhere
    await probe.wait_for(lambda r: not online(r, 0) and not online(r, 1), 30, "the killed peers' records to expire")
    trainer.signal(signal.SIGTERM)
    with pytest.raises(subprocess.TimeoutExpired):  # nothing it sent is held any more: the first SIGTERM drains
        trainer.proc.wait(timeout=DRAIN_WINDOW_S)
    trainer.signal(signal.SIGTERM)
    assert trainer.proc.wait(timeout=15) == 0
    done = trainer.wait_event("trainer_done", timeout=5)
    assert done["samples_sent"] > 0 and done["drained"] is False
    assert "leaving without waiting" in trainer.log_tail()
    assert group_is_empty(trainer.pid)


@pytest.mark.long
def test_demo_runs_and_stops_everything(tmp_path):
    run_id = f"demo{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "peers.cli", "demo", "--duration_s", "10", "--peers_per_stage", "1", "--num_trainers",
         "1", "--log_period_s", "3", "--max_data_mb", "1", "--target_batch_size", "32", "--run_id", run_id,
         "--work_dir", str(tmp_path), "--dashboard_port", "0", *TINY_MODEL], cwd=REPO, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, output
    assert "samples/s" in output and "stopping every process" in output
    assert "trainer0: sent" in output
    assert "dashboard: http://127.0.0.1:" in output, output
    leftovers = subprocess.run(["pgrep", "-f", run_id], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"demo left processes behind: {leftovers}"
    logs = {path.name: path.read_text(errors="replace") for path in tmp_path.glob("*.log")}
    assert len(logs) >= 5, sorted(logs)  # bootstrap, the dashboard, a peer per stage, the trainer
    noisy = {name: text[-2000:] for name, text in logs.items() if "Traceback" in text or "never retrieved" in text}
    assert not noisy, f"a normal run and stop left tracebacks in the logs: {noisy}"


async def test_a_task_that_lost_p2pd_is_one_line_and_other_failures_keep_their_traceback(caplog):
    import gc

    from peers._common import stop_event

    async def lost() -> None:
        raise ConnectionResetError(104, "Connection reset by peer")

    async def bug() -> None:
        raise KeyError("a bug")

    stop_event()  # installs the role's exception handler on this loop
    tasks = [asyncio.create_task(lost()), asyncio.create_task(bug())]
    await asyncio.wait(tasks)  # both failed; asyncio.wait leaves their exceptions unretrieved

    def reported() -> bool:
        return any("never retrieved" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.INFO):
        del tasks
        gc.collect()  # a task's exception is reported when the task is collected
        await await_until(reported, 10, "the collected tasks' exceptions to be reported")
    lost_lines = [r for r in caplog.records if "lost its connection to p2pd" in r.getMessage()]
    assert len(lost_lines) == 1 and lost_lines[0].levelno == logging.INFO and lost_lines[0].exc_info is None
    bug_lines = [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert len(bug_lines) == 1 and "KeyError" in str(bug_lines[0].__dict__), "a real bug must still be reported"
