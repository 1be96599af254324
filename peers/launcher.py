"""Start swarm roles as subprocesses and always stop them: used by ``swarm demo`` and by the tests.

Each role runs in its own session (process group), so that stopping it also stops the p2pd
daemons and hivemind processes it forked. Roles print JSON event lines on stdout; a reader
thread collects them so a caller can wait for 'peer_ready' and the like with a timeout.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["RoleProcess", "REPO", "stop_all"]

REPO = Path(__file__).resolve().parents[1]


class RoleProcess:
    """One ``swarm <role>`` subprocess with its stdout events and a log file for stderr."""

    def __init__(self, role: str, args: Sequence[str], log_dir: Path, name: str, prefix: Sequence[str] = ()):
        """``prefix``: a command the role runs under, e.g. ``ip netns exec NAME`` (it must exec the role,
        so that the pid is the role's own)."""
        self.role, self.name = role, name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning"}
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "peers.cli", role, *args],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
            env=env,
        )
        self.pid = self.proc.pid
        self.events: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.seen: List[Dict[str, Any]] = []
        self.stdout_lines: List[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        stdout = self.proc.stdout
        if stdout is None:
            raise RuntimeError(f"{self.name}: the role's stdout is not piped, so its events cannot be read")
        for line in stdout:
            self.stdout_lines.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict) and "event" in event:
                self.events.put(event)

    def wait_event(self, name: str, timeout: float) -> Dict[str, Any]:
        for event in self.seen:
            if event["event"] == name:
                return event
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self.events.get(timeout=0.2)
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    break
                continue
            self.seen.append(event)
            if event["event"] == name:
                return event
        raise TimeoutError(
            f"{self.name} did not report {name!r} within {timeout}s "
            f"(exit code {self.proc.poll()}); log tail:\n{self.log_tail()}"
        )

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:  # exited since the poll
                pass

    def kill_group(self) -> None:
        """SIGKILL the whole process group: the role, its p2pd daemons and forked helpers."""
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop(self, timeout: float = 20.0) -> Optional[int]:
        """SIGTERM, wait for a clean exit, then kill whatever is left of the group; returns the exit code."""
        return stop_all([self], timeout)[0]


def stop_all(processes: Sequence[RoleProcess], timeout: float) -> List[Optional[int]]:
    """SIGTERM every role at once, give them ``timeout`` seconds in all to leave gracefully, then
    SIGKILL every process group (p2pd daemons included); returns each role's clean exit code, or None."""
    for process in processes:
        process.signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    codes = [process.proc.poll() for process in processes]
    for process in processes:
        process.kill_group()
        process._log.close()
    return codes
