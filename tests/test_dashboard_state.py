"""The dashboard's data (``/api/state``) built from hand-made records, its history and its join commands."""

from __future__ import annotations

import json
import shlex

import pytest

from swarm.config.settings import PeerConfig, RunConfig
from swarm.config.loading import config_from_dict, parse_role_args
from swarm.dashboard.history import History, HistoryPoint
from swarm.dashboard.join import JoinInfo, join_commands, run_flags
from swarm.dashboard.state import Snapshot, build_state, history_point
from swarm.dht.records import AccusationRecord, PeerRecord, TrainerRecord


def peer(peer_id: str, stage: int, step: int, throughput: float = 10.0, state: str = "online", excluded: str = "",
         queue: int = 0) -> PeerRecord:
    return PeerRecord(version=1, peer_id=peer_id, stage=stage, state=state, throughput=throughput, queue_length=queue,
                      step=step, accum_step=step, samples_pending=5, samples_applied=0, excluded=excluded)


def trainer(trainer_id: str, loss, samples_per_s: float) -> TrainerRecord:
    return TrainerRecord(version=1, trainer_id=trainer_id, samples_sent=100, loss=loss, samples_per_s=samples_per_s,
                         tokens_per_s=samples_per_s * 16)


def snapshot() -> Snapshot:
    peers = [peer("a0", 0, 3, 20.0, queue=2), peer("b0", 0, 3, 30.0, queue=1), peer("c0", 0, 0, state="joining"),
             # stage 1: x1 is banned by both stage-mates, y1 only by x1 (a minority), z1 bans nobody
             peer("x1", 1, 4, 5.0, excluded="y1"), peer("y1", 1, 4, 6.0, excluded="x1"), peer("z1", 1, 4, 7.0, excluded="x1")]
    accusation = AccusationRecord(version=1, trainer_id="t1", accused="x1", witness="y1", referee="z1", stage=1,
                                  method="forward", step=4, inputs_hash="i", accused_hash="a", witness_hash="w")
    return Snapshot(peers={p.peer_id: p for p in peers},
                    trainers={"t1": trainer("t1", 4.0, 12.0), "t2": trainer("t2", 5.0, 8.0), "t3": trainer("t3", None, 1.0)},
                    accusations={"t1": accusation}, fetched_at=1000.0)


def test_state_sums_stages_marks_bans_and_accusations():
    history = History(max_points=10)
    snap = snapshot()
    history.add(history_point(snap, num_stages=2, t=1.0))
    state = build_state(snap, history, JoinInfo("run", 2, ("/ip4/1.2.3.4/tcp/5/p2p/QmX",)), uptime_s=1.0)
    json.dumps(state, allow_nan=False)  # the page reads it as strict JSON
    assert state["global_step"] == 4  # the last stage is the clock
    assert state["stages"][0] == {"stage": 0, "replicas": 2, "joining": 1, "leaving": 0, "throughput": 50.0, "queue": 3,
                                  "step": 3, "samples_pending": 10}
    assert state["stages"][1]["replicas"] == 3 and state["stages"][1]["throughput"] == 18.0
    assert state["swarm"] == {"loss": 4.5, "samples_per_s": 21.0, "tokens_per_s": 336.0, "num_peers": 5,
                              "num_trainers": 3}
    rows = {row["peer_id"]: row for row in state["peers"]}
    assert [row["peer_id"] for row in state["peers"]] == ["a0", "b0", "c0", "x1", "y1", "z1"]
    assert rows["x1"]["banned"] and rows["x1"]["excluded_by"] == ["y1", "z1"] and rows["x1"]["accused_by"] == ["t1"]
    assert not rows["y1"]["banned"] and rows["y1"]["excluded_by"] == ["x1"] and rows["y1"]["excluded"] == ["x1"]
    assert not rows["a0"]["banned"] and rows["a0"]["accused_by"] == [] and rows["c0"]["state"] == "joining"
    assert state["accusations"][0]["accused"] == "x1" and state["accusations"][0]["method"] == "forward"
    assert [t["loss"] for t in state["trainers"]] == [4.0, 5.0, None]
    assert state["history"]["loss"] == [4.5] and state["history"]["samples_per_s"] == [21.0]
    assert state["steps"] == [{"step": 4, "t": 1.0}] and state["poll"] == {"ok": True, "error": None}


def test_empty_swarm_has_no_step_and_no_loss():
    state = build_state(Snapshot(error="DHT lookup failed"), History(2), JoinInfo("run", 3), uptime_s=0.0)
    assert state["global_step"] is None and state["swarm"]["loss"] is None
    assert [s["replicas"] for s in state["stages"]] == [0, 0, 0] and all(s["step"] is None for s in state["stages"])
    assert state["poll"] == {"ok": False, "error": "DHT lookup failed"}


def test_history_is_bounded_and_records_each_new_step_once():
    history = History(max_points=3)
    for t, step in enumerate([0, 0, 1, 1, 2, 1, 3]):
        history.add(HistoryPoint(t=float(t), loss=5.0 - t / 10, samples_per_s=t, tokens_per_s=0.0, global_step=step))
    assert history.series()["t"] == [4.0, 5.0, 6.0]
    # bounded too; a step that goes back is not news
    assert history.step_marks() == [{"step": 1, "t": 2.0}, {"step": 2, "t": 4.0}, {"step": 3, "t": 6.0}]
    with pytest.raises(ValueError):
        history.add(HistoryPoint(t=1.0, loss=None, samples_per_s=0.0, tokens_per_s=0.0, global_step=None))
    with pytest.raises(ValueError):
        History(max_points=1)


def test_join_with_a_manifest_is_one_address():
    address = "/ip4/1.2.3.4/tcp/31330/p2p/QmOrganiser"
    join = join_commands(JoinInfo("run", 2, ("/ip4/9.9.9.9/tcp/1/p2p/QmOther",), manifest_address=address))
    assert join["peer"] == f"swarm peer --join {address}" and join["trainer"] == f"swarm train --join {address}"
    assert join["via"] == "manifest" and join["complete"]


def test_join_without_a_manifest_repeats_every_non_default_run_setting():
    run = config_from_dict(RunConfig, {"run_id": "myrun", "num_stages": 2, "target_batch_size": 64,
                                       "model": {"hidden_size": 32, "num_layers": 2, "stage_layers": [1, 1]},
                                       "optimizer": {"lr": 0.01}, "defences": False})
    info = JoinInfo("myrun", 2, ("/ip4/1.2.3.4/tcp/5/p2p/QmA", "/ip4/1.2.3.5/tcp/5/p2p/QmB"), run=run)
    join = join_commands(info)
    assert join["via"] == "initial_peers" and join["complete"]
    argv = shlex.split(join["peer"])
    assert argv[:2] == ["swarm", "peer"]
    # the command, parsed as `swarm peer` parses it, gives exactly the run's settings
    parsed = config_from_dict(PeerConfig, parse_role_args(PeerConfig, argv[2:], "swarm peer", "").settings)
    assert parsed.run == run and parsed.network.initial_peers == list(info.initial_peers)
    assert "--seed" not in argv and "--allowlist" not in argv  # defaults are left out
    partial = join_commands(JoinInfo("myrun", 2, ()))
    assert not partial["complete"] and partial["peer"] == "swarm peer --run_id myrun --num_stages 2"
    assert run_flags(RunConfig(run_id="r", num_stages=2)) == ["--run_id", "r", "--num_stages", "2"]
