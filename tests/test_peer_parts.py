"""The parts a stage peer is made of: its lifecycle (an explicit state machine), its compute thread's
counters, the backpressure wait of its step coordinator, and faults installed from outside."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from swarm.server.compute import ComputeThread
from swarm.server.faults import FaultyAverager, check_fault, install_fault
from swarm.server.lifecycle import IllegalTransition, Lifecycle, PeerState
from swarm.server.steps import StepCoordinator

ROOT = Path(__file__).resolve().parent.parent


# ---- lifecycle ----

def test_the_lifecycle_allows_only_its_transitions():
    life = Lifecycle()
    assert life.state is PeerState.JOINING and not life.online
    life.to(PeerState.JOINING)  # staying put is allowed
    life.to(PeerState.ONLINE)
    assert life.online
    with pytest.raises(IllegalTransition, match="from online to joining"):
        life.to(PeerState.JOINING)
    life.to(PeerState.LEAVING)
    assert life.stage_done.is_set(), "leaving a stage ends its coordinator"
    life.to(PeerState.JOINING)  # moving to another stage
    assert not life.stage_done.is_set(), "a new stage has a stage_done of its own"
    life.to(PeerState.STOPPED)
    with pytest.raises(IllegalTransition):
        life.to(PeerState.ONLINE)


def test_the_state_is_announced_by_its_value():
    assert PeerState.ONLINE == "online" and str(PeerState.LEAVING) == "leaving"


async def test_a_loop_wakes_on_progress_but_not_before_its_minimum():
    life = Lifecycle()
    waiting = asyncio.create_task(life.sleep_or_progress("coordinate", period_s=30.0, min_period_s=0.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    life.notify_progress()
    await asyncio.wait_for(waiting, 2.0)
    others = asyncio.create_task(life.sleep_or_progress(None, period_s=30.0, min_period_s=0.0))
    life.notify_progress()  # a loop without a waker is not woken by progress...
    await asyncio.sleep(0.05)
    assert not others.done()
    life.stopping.set()  # ...only by the peer stopping
    await asyncio.wait_for(others, 2.0)


# ---- the compute thread's counters ----

async def test_counts_return_to_zero_when_a_request_fails_or_is_cancelled():
    compute = ComputeThread()
    try:
        blocker = asyncio.Event()

        async def served() -> None:
            with compute.serving():
                with compute.queue():
                    await blocker.wait()

        task = asyncio.create_task(served())
        await asyncio.sleep(0.01)
        assert (compute.in_flight, compute.queued) == (1, 1)
        assert not await compute.wait_idle(0.05)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert (compute.in_flight, compute.queued) == (0, 0)
        assert await compute.wait_idle(0.05)
        with pytest.raises(ZeroDivisionError):
            await compute.run(lambda: 1 / 0)
        assert compute.queued == 0
        assert await compute.run(lambda x: x + 1, 1) == 2
    finally:
        compute.shutdown()


# ---- backpressure: a waiting backward wakes when the decision may have changed ----

async def test_a_backward_waiting_for_room_is_let_in_when_room_is_signalled():
    host = SimpleNamespace(config=SimpleNamespace(averaging_timeout_s=30.0), notify_progress=lambda: None)
    steps = StepCoordinator(host)
    blocked = [True]
    steps.must_wait = lambda: blocked[0]
    waiting = asyncio.create_task(steps.wait_for_room(4))
    await asyncio.sleep(0.1)
    blocked[0] = False
    await asyncio.sleep(0.1)
    assert not waiting.done(), "nothing said the decision may have changed: no poll takes it again"
    steps.room_may_have_changed()
    await asyncio.wait_for(waiting, 1.0)
    assert steps.admitted == 4
    steps.release(4)
    assert steps.admitted == 0


async def test_the_wait_for_room_is_bounded_by_the_averaging_timeout():
    host = SimpleNamespace(config=SimpleNamespace(averaging_timeout_s=0.2), notify_progress=lambda: None)
    steps = StepCoordinator(host)
    steps.must_wait = lambda: True
    await asyncio.wait_for(steps.wait_for_room(2), 2.0)
    assert steps.admitted == 2


async def test_a_trainers_clock_hint_wakes_the_coordinator_once_per_step_and_is_capped_at_the_next_step():
    woken = []
    runner = SimpleNamespace(accum_step=5)
    host = SimpleNamespace(config=SimpleNamespace(averaging_timeout_s=30.0), runner=runner,
                           notify_progress=lambda: woken.append(True))
    steps = StepCoordinator(host)
    for junk in ("6", True, 6.0, None, -1, 0):
        steps.hear_clock_hint(junk)
    assert woken == [], "only a step number is a hint"
    steps.hear_clock_hint(10**9)
    assert steps._clock_hint == 6 and len(woken) == 1, "a hint can only close the step the replica is on"
    steps.hear_clock_hint(6)
    assert len(woken) == 1, "the same hint again is no news"
    runner.accum_step = 6
    steps.hear_clock_hint(7)
    assert steps._clock_hint == 7 and len(woken) == 2


# ---- faults come from outside ----

class _Handlers:
    def table(self):
        async def forward(request, caller):
            return {"outputs": torch.ones(2, 3), "step": 0}

        async def info(request, caller):
            return {"ok": True}

        return {"forward": forward, "backward": forward, "info": info}


def _fake_peer():
    state = ({"step": 0}, [torch.zeros(2), torch.zeros(2), torch.zeros(2), torch.zeros(1)])
    return SimpleNamespace(handlers=_Handlers(), averager_class=None, shared_state=lambda: state,
                           served_state=lambda: state)


async def test_a_reply_fault_wraps_the_handlers_and_nothing_else():
    peer = _fake_peer()
    install_fault(peer, "nan_outputs")
    table = peer.handlers.table()
    reply = await table["forward"]({}, "caller")
    assert torch.isnan(reply["outputs"]).all()
    assert await table["info"]({}, "caller") == {"ok": True}
    assert peer.averager_class is None and peer.served_state()[1][0].eq(0).all()


def test_gradient_and_state_faults_swap_the_averager_and_the_served_state():
    peer = _fake_peer()
    install_fault(peer, "sign_flip_gradients")
    assert peer.averager_class.func is FaultyAverager and peer.averager_class.keywords == {"fault": "sign_flip_gradients"}
    peer = _fake_peer()
    install_fault(peer, "poisoned_state")
    served = peer.served_state()[1]
    assert not served[0].eq(0).all(), "the parameters it serves are noise"
    assert peer.shared_state()[1][0].eq(0).all(), "what it holds is unchanged"


def test_an_unknown_fault_is_refused():
    with pytest.raises(ValueError, match="fault must be one of"):
        check_fault("gentle_lies")


def test_no_honest_module_imports_the_faults():
    """Only the faulty-peer role and tests reach swarm.server.faults: the honest path has no fault to check."""
    importers = []
    for path in list((ROOT / "swarm").rglob("*.py")) + list((ROOT / "peers").rglob("*.py")):
        if path.name == "faults.py" or path.name == "faulty_peer.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(name.startswith("swarm.server.faults") for name in names):
                importers.append(str(path.relative_to(ROOT)))
    assert importers == []
