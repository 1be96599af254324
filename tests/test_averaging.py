"""After global steps, every replica of a stage holds identical parameters, all stages at one step
(with the run's compression too); a round still looking for a group can be called off."""

from __future__ import annotations

import asyncio

import pytest
import torch

from swarm.server.averaging import RoundGivenUp, await_round
from tests.utils.probe import online

TARGET = 64


@pytest.mark.long
async def test_replicas_identical_and_stages_in_step(launcher, probe):
    launcher.wait_ready([launcher.peer(stage, target_batch_size=TARGET, wait=False) for stage in (0, 0, 1, 1)])
    await probe.wait_for(lambda r: all(len(online(r, s)) == 2 for s in (0, 1)), 30, "2 replicas per stage")
    trainers = [launcher.trainer(target_batch_size=TARGET, extra=["--max_samples", "96", "--trainer_seed", str(i),
                                                                   "--batch_size", "8"]) for i in (1, 2)]
    done = [t.wait_event("trainer_done", timeout=120) for t in trainers]
    assert sum(d["samples_sent"] for d in done) == 192

    # the last stage closes a global step once it holds at least TARGET samples (a few more when
    # micro-batches are in flight); the other stages close theirs when it does, so all stages
    # take the same number of steps
    def settled(r) -> bool:
        if len(r) != 4 or len({rec.step for rec in r.values()}) != 1 or any(rec.samples_frozen for rec in r.values()):
            return False
        if sum(rec.samples_pending for rec in online(r, 1)) >= TARGET:
            return False  # the last stage still has a step to close
        return all(max(x.samples_applied for x in online(r, s)) + sum(x.samples_pending for x in online(r, s)) == 192
                   for s in (0, 1))

    records = await probe.wait_for(settled, 60, "all replicas at one step, every stage accounting for 192 samples")
    assert next(iter(records.values())).step >= 1
    for stage in (0, 1):
        replicas = online(records, stage)
        for record in replicas:  # every step was an all-reduce of both replicas, not two local steps
            for step in range(record.step):
                members = (await probe.call(record.peer_id, "step_members", {"stage": stage, "step": step}))["members"]
                assert sorted(members) == sorted(r.peer_id for r in replicas), (stage, step, members)
                assert record.contributed_to(step) is True
        exported = [await probe.call(r.peer_id, "parameters", {}) for r in replicas]
        assert exported[0]["step"] == exported[1]["step"]
        for a, b in zip(exported[0]["parameters"], exported[1]["parameters"]):
            assert torch.equal(a, b), f"stage {stage} replicas differ"


@pytest.mark.long
@pytest.mark.parametrize("codec", ["int8", "ternary"])
async def test_replicas_averaging_compressed_gradients_stay_identical(launcher, probe, codec):
    """Activations, their gradients and the stage all-reduce in int8, or gradients in ternary: each replica
    aggregates the decoded gradients (its own included), so the replicas of a stage still hold bit-identical parameters."""
    settings = ["--compression", "int8"] if codec == "int8" else ["--gradient_compression", "ternary"]
    replicas = [launcher.peer(0, target_batch_size=32, extra=settings, wait=False) for _ in range(2)]
    last = launcher.peer(1, target_batch_size=32, extra=settings, wait=False)
    for peer in (*replicas, last):  # started together: a peer's start-up is most of this test's time
        peer.wait_event("peer_ready", timeout=90)
    await probe.wait_for(lambda r: len(online(r, 0)) == 2 and len(online(r, 1)) == 1, 30, "2 + 1 replicas online")
    trainer = launcher.trainer(target_batch_size=32, extra=[*settings, "--max_samples", "64", "--batch_size", "8"])
    assert trainer.wait_event("trainer_done", timeout=60)["samples_sent"] == 64

    def settled(r) -> bool:
        return (len(r) == 3 and len({rec.step for rec in r.values()}) == 1 and next(iter(r.values())).step >= 1
                and not any(rec.samples_frozen for rec in r.values()))

    records = await probe.wait_for(settled, 30, "all replicas at one step, at least 1")
    stage0 = online(records, 0)
    assert len({r.digest for r in stage0}) == 1, [r.digest for r in stage0]
    for step in range(stage0[0].step):  # averaged together, not applied alone
        members = (await probe.call(stage0[0].peer_id, "step_members", {"stage": 0, "step": step}))["members"]
        assert sorted(members) == sorted(r.peer_id for r in stage0), (step, members)
    exported = [await probe.call(r.peer_id, "parameters", {}) for r in stage0]
    assert all(torch.equal(a, b) for a, b in zip(exported[0]["parameters"], exported[1]["parameters"]))
    # identical by construction, not because a replica downloaded the other's state after diverging
    assert not any("out of sync" in peer.log_tail(20_000) for peer in replicas)


def test_a_failed_round_is_reported_once_without_hiveminds_traceback():
    import logging
    import sys

    from hivemind.averaging.matchmaking import MatchmakingException
    from hivemind.averaging.partition import AllreduceException

    from swarm.server.averaging import ReportedRoundFailures

    def record(error: BaseException) -> logging.LogRecord:
        try:
            raise error
        except BaseException:
            return logging.LogRecord("hivemind.averaging.averager", logging.ERROR, __file__, 1, str(error), (),
                                     sys.exc_info())

    quiet = ReportedRoundFailures()
    assert not quiet.filter(record(AllreduceException("Averaging step failed: could not find a group")))
    assert not quiet.filter(record(MatchmakingException("the leader left")))
    assert quiet.filter(record(RuntimeError("a real fault")))  # anything else keeps its traceback
    assert quiet.filter(logging.LogRecord("hivemind.averaging.averager", logging.WARNING, __file__, 1, "w", (), None))
    ReportedRoundFailures.install()
    ReportedRoundFailures.install()
    filters = logging.getLogger(ReportedRoundFailures.LOGGER).filters
    assert sum(isinstance(f, ReportedRoundFailures) for f in filters) == 1


class _Round:
    """Stands in for hivemind's StepControl: an awaitable round that may have begun its all-reduce."""

    def __init__(self, began_allreduce: bool = False):
        self.future = asyncio.get_running_loop().create_future()
        self.began_allreduce, self.cancelled = began_allreduce, False

    def __await__(self):
        return self.future.__await__()

    def cancel(self) -> bool:
        self.cancelled = True
        return self.future.cancel()


async def _soon(result=None, error: BaseException = None):
    await asyncio.sleep(0.01)
    if error is not None:
        raise error
    return result


async def test_a_round_still_looking_for_a_group_is_called_off_when_asked():
    searching = _Round()
    with pytest.raises(RoundGivenUp):
        await await_round(searching, 5.0, _soon)
    assert searching.cancelled, "hivemind's averager is told to stop looking"


async def test_a_round_already_averaging_or_done_is_not_called_off():
    averaging = _Round(began_allreduce=True)  # its group needs our part: it is waited for
    asyncio.get_running_loop().call_later(0.05, averaging.future.set_result, {"gathered": 1})
    assert await await_round(averaging, 5.0, _soon) == {"gathered": 1} and not averaging.cancelled
    done = _Round()
    done.future.set_result({"gathered": 2})
    assert await await_round(done, 5.0, lambda: asyncio.sleep(10)) == {"gathered": 2}
    # a watcher that failed says nothing about the round
    failing = _Round()
    asyncio.get_running_loop().call_later(0.05, failing.future.set_result, {"gathered": 3})
    assert await await_round(failing, 5.0, lambda: _soon(error=RuntimeError("lookup failed"))) == {"gathered": 3}


class _HungDHT:
    """A DHT whose stores never complete (a busy DHT process): counts them, and what they declared."""

    def __init__(self):
        self.values = []

    def store(self, key, subkey, value, expiration_time, return_future, **traversal):  # hivemind's declaring loop
        self.values.append(value)
        return asyncio.get_running_loop().create_future()

    def run_coroutine(self, store, return_future):  # ours: swarm.dht.node.store_in_dht in the DHT process
        self.values.append(store.keywords["value"])
        return asyncio.get_running_loop().create_future()


def _declaring_averager(robust: bool):
    from types import SimpleNamespace

    from swarm.server.averaging import StageAverager

    fake = SimpleNamespace(_aggregation=object() if robust else None, dht=_HungDHT(), declare_state_period=0.05,
                           _state_updated=asyncio.Event(), allow_state_sharing=True, state_sharing_priority=0.0,
                           peer_id=SimpleNamespace(to_bytes=lambda: b"peer"),
                           _matchmaking=SimpleNamespace(group_key_manager=SimpleNamespace(prefix="run_stage0")))
    fake._declare_once = lambda *args: StageAverager._declare_once(fake, *args)
    # hivemind's loop reads the private names, ours the names swarm.hivemind_private.PrivateAverager gives them
    fake.state_updated, fake.matchmaking = fake._state_updated, fake._matchmaking
    return fake


async def _declare_for(seconds: float, loop_fn, averager) -> list:
    """Run a declaring loop for ``seconds``; the asyncio errors it left behind once its tasks are collected."""
    import gc

    errors = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: errors.append(context))
    try:
        task = asyncio.ensure_future(loop_fn(averager))
        await asyncio.sleep(seconds)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0.05)
        gc.collect()
    finally:
        loop.set_exception_handler(previous)
    return errors


async def test_declarations_that_time_out_leave_no_unretrieved_task_errors():
    from hivemind import DecentralizedAverager

    from swarm.server.averaging import StageAverager

    hiveminds = await _declare_for(0.3, DecentralizedAverager._declare_for_download_periodically,
                                   _declaring_averager(robust=False))
    assert any("never retrieved" in context.get("message", "") for context in hiveminds), \
        "hivemind's own loop leaks the store tasks that time out (else this test shows nothing)"
    undefended = _declaring_averager(robust=False)
    assert await _declare_for(0.3, StageAverager._declare_for_download_periodically, undefended) == []
    assert len(undefended.dht.values) >= 3 and set(undefended.dht.values) == {0.0}, "it still declares, every period"
    robust = _declaring_averager(robust=True)
    assert await _declare_for(0.3, StageAverager._declare_for_download_periodically, robust) == []
    assert robust.dht.values == [], "with robust aggregation nobody reads the declarations: none are made"
