"""``swarm faulty_peer --fault NAME``: a stage peer that misbehaves on purpose, for tests and attack benchmarks.

It takes every option of ``swarm peer`` plus ``--fault`` (one of :data:`swarm.server.faults.FAULTS`) and
installs the fault on the peer from outside (:func:`swarm.server.faults.install_fault`) before it starts:
``swarm peer`` itself has no fault to emulate.
"""

from __future__ import annotations

import argparse
from typing import Optional, Sequence

from peers._common import fail


def main(argv: Optional[Sequence[str]] = None) -> int:
    from peers import peer
    from swarm.server.faults import FAULTS, install_fault

    parser = argparse.ArgumentParser(prog="swarm faulty_peer", add_help=False)
    parser.add_argument("--fault", required=True, choices=FAULTS, help="the fault this replica emulates")
    known, rest = parser.parse_known_args(list(argv or []))
    if known.fault == "none":
        return fail("--fault none is an honest peer: run `swarm peer` instead")
    return peer.main(rest, prepare=lambda stage_peer: install_fault(stage_peer, known.fault))
