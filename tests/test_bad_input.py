"""Malformed requests get a clear error and the peer keeps serving; bad records and configs are refused."""

from __future__ import annotations

import subprocess
import sys
import uuid

import pytest
import pytest_asyncio
import torch
from hivemind import DHT
from hivemind.p2p import PeerID
from hivemind.proto import runtime_pb2
from hivemind.utils import get_dht_time

from swarm.dht.node import blacklisted_peers
from swarm.dht.records import stage_key
from swarm.net.rpc import NAMESPACE, RemoteError, RPCServicer
from swarm.net.wire import decode
from tests.utils.probe import Probe, online
from tests.utils.processes import REPO, Launcher

module_loop = pytest.mark.asyncio(loop_scope="module")  # async tests share the module-scoped swarm
HIDDEN, SEQ = 32, 16


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def swarm(tmp_path_factory):
    launcher = Launcher(tmp_path_factory.mktemp("bad_input"), run_id=f"bad{uuid.uuid4().hex[:6]}")
    probe = None
    try:
        launcher.bootstrap()
        launcher.peer(0, extra=["--max_message_mb", "1", "--max_batch_samples", "32"])
        launcher.peer(1)
        probe = Probe(launcher.initial_peers, launcher.run_id)
        records = await probe.wait_for(lambda r: all(online(r, s) for s in (0, 1)), 30, "both stages online")
        yield probe, online(records, 0)[0].peer_id, online(records, 1)[0].peer_id
    finally:
        if probe is not None:
            probe.shutdown()
        launcher.close()


def hidden(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, SEQ, HIDDEN)


def tokens(batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, SEQ))


BAD_REQUESTS = {
    "wrong hidden size": (1, {"inputs": torch.randn(2, SEQ, HIDDEN + 1), "targets": tokens()}, "hidden states must be"),
    "wrong dtype": (1, {"inputs": hidden().half(), "targets": tokens()}, "dtype"),
    "nan": (1, {"inputs": hidden().index_fill_(0, torch.tensor([1]), float("nan")), "targets": tokens()}, "NaN"),
    "inf": (1, {"inputs": hidden().index_fill_(0, torch.tensor([0]), float("inf")), "targets": tokens()}, "inf"),
    "missing targets": (1, {"inputs": hidden()}, "targets are required"),
    "targets shape": (1, {"inputs": hidden(), "targets": tokens(3)}, "targets shape"),
    "token out of range": (0, {"inputs": tokens().index_fill_(0, torch.tensor([0]), 999)}, "token ids must lie"),
    "float tokens": (0, {"inputs": tokens().float()}, "int64"),
    "sequence too long": (0, {"inputs": torch.randint(0, 256, (2, SEQ + 1))}, "sequence length"),
    "batch too large": (0, {"inputs": tokens(33)}, "exceeds this peer's limit"),
    "not a tensor": (0, {"inputs": [1, 2, 3]}, "inputs must be a torch.Tensor"),
    "someone else's micro-batch id": (0, {"inputs": tokens(), "micro_batch_id": "12D3KooWvictim:7"},
                                      "does not belong to the caller"),
    "micro-batch id not a string": (0, {"inputs": tokens(), "micro_batch_id": 7}, "micro_batch_id must be"),
}


@module_loop
@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
async def test_malformed_request_is_refused_and_peer_keeps_serving(swarm, case):
    probe, first, last = swarm
    stage, message, expected = BAD_REQUESTS[case]
    peer = first if stage == 0 else last
    with pytest.raises(RemoteError) as error:
        await probe.call(peer, "forward", {"stage": stage, **message})
    assert error.value.kind == "bad_request" and expected in str(error.value), str(error.value)
    await assert_still_serving(probe, first, last)


async def assert_still_serving(probe, first, last) -> None:
    out = (await probe.call(first, "forward", {"stage": 0, "inputs": tokens()}))["outputs"]
    assert out.shape == (2, SEQ, HIDDEN)
    loss = (await probe.call(last, "forward", {"stage": 1, "inputs": out, "targets": tokens()}))["loss"]
    assert 0 < loss < 20


@module_loop
async def test_backward_with_bad_gradient_is_refused(swarm):
    probe, first, last = swarm
    for grad, expected in ((torch.randn(2, SEQ, HIDDEN + 1), "grad_outputs must be"),
                           (torch.full((2, SEQ, HIDDEN), float("nan")), "NaN")):
        with pytest.raises(RemoteError, match=expected):
            await probe.call(first, "backward", {"stage": 0, "micro_batch_id": f"{probe.peer_id}:x", "inputs": tokens(),
                                                 "grad_outputs": grad})
    with pytest.raises(RemoteError, match="micro_batch_id"):
        await probe.call(first, "backward", {"stage": 0, "inputs": tokens(), "grad_outputs": hidden()})
    info = await probe.call(first, "info", {})
    assert info["samples_pending"] == 0, "a refused backward must not accumulate anything"
    await assert_still_serving(probe, first, last)


@module_loop
async def test_unknown_stage_and_method(swarm):
    probe, first, last = swarm
    with pytest.raises(RemoteError, match="serves stage 0") as error:
        await probe.call(first, "forward", {"stage": 1, "inputs": hidden(), "targets": tokens()})
    assert error.value.kind == "wrong_stage"
    with pytest.raises(RemoteError, match="unknown method"):
        await probe.call(first, "format_disk", {"stage": 0})
    await assert_still_serving(probe, first, last)


@module_loop
async def test_oversized_message_is_refused(swarm):
    probe, first, last = swarm
    big = torch.randint(0, 256, (2, 160_000))  # 2.5 MB of tokens > the peer's 1 MiB limit; goes as a stream
    with pytest.raises(RemoteError, match="exceeds"):
        await probe.call(first, "forward", {"stage": 0, "inputs": big})
    await assert_still_serving(probe, first, last)


@module_loop
async def test_garbage_bytes_are_refused(swarm):
    probe, first, last = swarm
    await probe.call(first, "info", {})  # creates the probe's P2P replica
    stub = RPCServicer.get_stub(probe._p2p, PeerID.from_base58(first), namespace=NAMESPACE)
    for garbage in (b"\xc1\xff\x00garbage", b"\x93\x01\x02\x03", b""):
        response = await stub.rpc_unary(runtime_pb2.ExpertRequest(uid="forward", metadata=garbage), timeout=10)
        reply = decode(response.metadata)
        assert reply["kind"] == "bad_request" and reply["error"], reply
    tensor_lie = {"stage": 0, "inputs": {"__tensor__": True, "dtype": "int64", "shape": [2, 16], "data": b"\x00" * 7}}
    with pytest.raises(RemoteError, match="needs 256 bytes"):
        await probe.call(first, "forward", tensor_lie)
    await assert_still_serving(probe, first, last)


@module_loop
async def test_garbage_dht_records_are_ignored(swarm):
    """A node that runs no validators stores junk under the run's keys: plain values, non-owner
    subkeys, malformed records. Readers still see exactly the two real peers, which keep serving."""
    probe, first, last = swarm
    raw = DHT(initial_peers=probe.dht.get_visible_maddrs(), host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
    try:
        expiration = get_dht_time() + 30
        for key in (stage_key(probe.run_id, 0), stage_key(probe.run_id, 1)):
            raw.store(key, {"version": 1, "peer_id": "fake", "stage": "zero"}, expiration, subkey="fake")
            raw.store(key, "not even a dict", expiration + 1)
            raw.store(key, {"peer_id": first, "stage": 0, "state": "leaving"}, expiration, subkey=first)
        records = await probe.records()
        assert set(records) == {first, last}
        assert all(r.state == "online" for r in records.values())
        # the node that answered with junk is not asked again for a while
        assert str(raw.peer_id) in await probe.dht.run_coroutine(blacklisted_peers, return_future=True)
    finally:
        raw.shutdown()
    await assert_still_serving(probe, first, last)


@pytest.mark.parametrize("args, field", [
    (["--stage", "5"], "stage must be in 0..1"),
    (["--hidden_size", "30", "--num_heads", "4"], "hidden_size"),
    (["--run_id", "has.dot"], "run_id"),
    (["--announce_period_s", "-1"], "announce_period_s"),
    (["--num_layers", "two"], "num_layers"),
])
def test_wrong_config_is_refused_naming_the_field(args, field):
    result = subprocess.run([sys.executable, "-m", "peers.cli", "peer", *args], cwd=REPO, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert field in result.stderr and "Traceback" not in result.stderr, result.stderr
