"""An emulated slower device: a stage replica that takes a fixed time more per sample of backward work.

How the tests and benchmarks build heterogeneous swarms on one machine: the extra time is a sleep, which costs
no CPU, so a replica's speed does not depend on the cores its neighbours use. It is installed from outside,
on a peer that has not started (:func:`install_slow_device`; ``swarm peer`` does it when
``--delay_per_sample_s`` is above 0), so the runner that serves real devices carries no emulation. The sleep
runs on the peer's compute thread, where the runner computes.
"""

from __future__ import annotations

import functools
import time
from typing import TYPE_CHECKING, Any

from swarm.server.runner import StageRunner

if TYPE_CHECKING:
    from swarm.server.peer import StagePeer

__all__ = ["SlowDeviceRunner", "install_slow_device"]


class SlowDeviceRunner(StageRunner):
    """A :class:`StageRunner` whose backward work takes ``delay_per_sample_s`` seconds more a sample, whatever
    the load: served backwards and the timed rounds of its speed test, so that the speed it measures and
    announces includes the delay, and merged backwards."""

    def __init__(self, *args: Any, delay_per_sample_s: float, **kwargs: Any):
        _check_delay(delay_per_sample_s)
        super().__init__(*args, **kwargs)
        self.delay_per_sample_s = delay_per_sample_s

    def _after_backward_compute(self, samples: int) -> None:
        time.sleep(self.delay_per_sample_s * samples)


def install_slow_device(peer: "StagePeer", delay_per_sample_s: float) -> None:
    """Make ``peer`` (not started yet) compute as on a device ``delay_per_sample_s`` seconds a sample of backward
    work slower: every runner it builds, for its first stage and for each stage it moves to, is a
    :class:`SlowDeviceRunner`."""
    _check_delay(delay_per_sample_s)
    peer.runner_class = functools.partial(SlowDeviceRunner, delay_per_sample_s=delay_per_sample_s)


def _check_delay(delay_per_sample_s: float) -> None:
    if not delay_per_sample_s >= 0.0:
        raise ValueError(f"delay_per_sample_s must be >= 0, got {delay_per_sample_s!r}")
