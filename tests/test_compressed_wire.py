"""The run's compression on the wire, with no network: forward/backward requests and replies travel
compressed, everything else exact; the setting is validated, reaches the CLI, and is part of the run's
agreement; verification tolerates what compression adds and nothing more."""

from __future__ import annotations

import asyncio
import dataclasses
from types import SimpleNamespace
from typing import Any, Dict, List

import msgpack
import pytest
import torch

from swarm.client.verification import compression_slack
from swarm.net.compression import compress, decompress, error_bound, gradient_codec
from swarm.config.settings import PeerConfig, RunConfig
from swarm.config.loading import ConfigError, config_from_dict, parse_role_args
from swarm.dht.manifest import run_differences, run_hash, run_settings
from swarm.net.rpc import RPCServicer, call_peer
from swarm.server.handlers import COMPRESSED_METHODS
from swarm.net.wire import decode, encode
from tests.utils.memory_stream import MemoryStreams


class FakeCaller:
    """Stands in for a hivemind PeerID: the servicer only uses str(caller)."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return self.name


class LoopbackP2P:
    """Hands a stub's calls straight to an in-process servicer, noting which kind of call each was."""

    def __init__(self, servicer: RPCServicer):
        self.servicer = servicer
        self.calls: List[str] = []

    async def call_protobuf_handler(self, peer, name, request, response_type):
        self.calls.append("unary")
        return await self.servicer.rpc_unary(request, SimpleNamespace(remote_id=FakeCaller("trainer")))

    async def call_binary_stream_handler(self, peer, name):
        self.calls.append("stream")
        return await MemoryStreams(self.servicer, "trainer").open()


def activation(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def servicer(handlers: Dict[str, Any], compression: str) -> RPCServicer:
    return RPCServicer(handlers, compression=compression, compress_replies=COMPRESSED_METHODS)


# ---- bytes ----

def test_an_int8_forward_reply_is_at_least_3_9_times_smaller():
    reply = {"outputs": activation(16, 128, 256), "step": 12, "digest": "0123456789abcdef"}
    sizes = {codec: len(encode(reply, codec)) for codec in ("none", "fp16", "int8")}
    print(f"forward reply of 16x128x256 float32: {sizes}; none/fp16 {sizes['none'] / sizes['fp16']:.3f}, "
          f"none/int8 {sizes['none'] / sizes['int8']:.3f}")
    assert sizes["none"] / sizes["int8"] >= 3.9
    assert sizes["none"] / sizes["fp16"] >= 1.99


# ---- the setting ----

@pytest.mark.parametrize("changes, field", [
    ({"compression": "zip"}, "compression"), ({"compression": None}, "compression"),
    ({"compression_block_size": 32}, "compression_block_size"),
    ({"compression_block_size": 8192}, "compression_block_size"),
    ({"compression_block_size": True}, "compression_block_size"),
    ({"gradient_compression": "int4"}, "gradient_compression"),
    ({"gradient_compression": "ternary", "defences": False}, "gradient_compression ternary needs defences on"),
])
def test_bad_compression_settings_are_refused_naming_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        RunConfig(**changes)


def test_compression_is_a_run_flag_and_part_of_the_run_agreement():
    role = parse_role_args(PeerConfig, ["--compression", "int8", "--compression_block_size", "128"], "peer", "")
    config = config_from_dict(PeerConfig, role.settings)
    assert (config.run.compression, config.run.compression_block_size) == ("int8", 128)
    with pytest.raises(ConfigError, match="compression"):
        config_from_dict(PeerConfig, parse_role_args(PeerConfig, ["--compression", "int2"], "peer", "").settings)
    with pytest.raises(ConfigError, match="gradient_compression must be empty"):  # int4 is for activations only
        config_from_dict(PeerConfig, parse_role_args(PeerConfig, ["--gradient_compression", "int4"], "peer", "").settings)
    assert RunConfig(compression="int8").gradient_codec == "int8"
    assert RunConfig(compression="int4").gradient_codec == "int8"
    assert RunConfig(compression="int4", gradient_compression="ternary").gradient_codec == "ternary"
    assert RunConfig(compression="int8", gradient_compression="ternary").gradient_codec == "ternary"
    plain = RunConfig()
    for other in (dataclasses.replace(plain, compression="int8"),
                  dataclasses.replace(plain, compression_block_size=512)):
        assert run_hash(other) != run_hash(plain)  # peers announce it: records of the other setting are ignored
        # what a joiner with other settings is refused with (swarm.dht.agreement names the first differing field)
        assert run_differences(plain, other)[0][0].startswith("compression")
    signed_settings = run_settings(dataclasses.replace(plain, compression="fp16"))  # what a manifest carries
    assert config_from_dict(RunConfig, signed_settings).compression == "fp16"


# ---- the RPC layer ----

async def _forward(message: Dict[str, Any], caller: str) -> Dict[str, Any]:
    return {"outputs": message["inputs"] * 2, "step": 1}


def test_forward_and_backward_travel_compressed_and_other_methods_exact():
    x = activation(4, 16, 32)

    async def parameters(message, caller):
        return {"parameters": [x]}

    handlers = {"forward": _forward, "backward": _forward, "parameters": parameters}
    for codec in ("none", "fp16", "int8", "int4"):
        p2p = LoopbackP2P(servicer(handlers, codec))
        for method in ("forward", "backward"):
            reply = asyncio.run(call_peer(p2p, FakeCaller("peer"), method, {"inputs": x}, timeout=10,
                                          compression=codec))
            # the request and the reply were both compressed once: the error of each is bounded
            sent = x if codec == "none" else decompress(compress(x, codec))
            expected = sent * 2 if codec == "none" else decompress(compress(sent * 2, codec))
            assert reply["outputs"].dtype == torch.float32 and torch.equal(reply["outputs"], expected), (codec, method)
        exported = asyncio.run(call_peer(p2p, FakeCaller("peer"), "parameters", {}, timeout=10, compression=codec))
        assert torch.equal(exported["parameters"][0], x)  # parameters are compared bit for bit: never compressed


def test_replies_are_measured_and_streamed_by_their_compressed_size():
    x = activation(100_000)  # 400 KB in float32: a stream; 100 KB in int8: one unary call each way
    for codec, kind in (("none", "stream"), ("int8", "unary")):
        p2p = LoopbackP2P(servicer({"forward": _forward}, codec))
        reply = asyncio.run(call_peer(p2p, FakeCaller("peer"), "forward", {"inputs": x}, timeout=30, compression=codec))
        assert p2p.calls == [kind] and reply["outputs"].shape == x.shape, (codec, p2p.calls)


@pytest.mark.parametrize("codec, value", [("int8", float("nan")), ("fp16", float("inf")), ("fp16", 1e6)])
def test_a_reply_that_cannot_be_compressed_is_a_clear_error(codec, value):
    async def broken(message, caller):
        return {"outputs": torch.full((8, 16), value)}

    reply = decode(asyncio.run(servicer({"forward": broken}, codec)._dispatch("forward", encode({}), FakeCaller("t"))))
    assert reply["kind"] == "internal" and "cannot be compressed" in reply["error"], reply


def test_a_request_that_cannot_be_compressed_goes_exact():
    huge = torch.full((8, 16), 1e6)  # beyond float16's range: the caller's own values, sent as they are

    async def echo(message, caller):
        return {"step": 0, "inputs_max": float(message["inputs"].max())}

    reply = asyncio.run(call_peer(LoopbackP2P(servicer({"backward": echo}, "fp16")), FakeCaller("peer"), "backward",
                                  {"inputs": huge}, timeout=10, compression="fp16"))
    assert reply["inputs_max"] == 1e6


# ---- verification's tolerance ----

def _relative_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / max(a.double().norm(), b.double().norm()))


@pytest.mark.parametrize("codec", ["fp16", "int8"])
def test_slack_covers_honest_replicas_that_differ_by_float_noise_and_not_a_corruption(codec):
    x = activation(16, 16, 32)
    twin = x * (1 + 1e-6 * activation(16, 16, 32, seed=1))  # another device's rounding
    first, second = decompress(compress(x, codec)), decompress(compress(twin, codec))
    slack = compression_slack([{"outputs": first}, {"outputs": second}], ["outputs", "loss"], codec, 256)
    assert _relative_distance(first, second) <= 1e-4 + slack
    # the bound is what error_bound promises, and is far below any corruption that matters (0.1 and up)
    bound = float(error_bound(compress(x, codec)).double().norm() / x.double().norm())
    assert slack == pytest.approx(2 * bound, rel=1e-3) and slack < 0.05
    noisy = decompress(compress(x + 0.5 * x.std() * activation(16, 16, 32, seed=2), codec))
    assert _relative_distance(first, noisy) > 1e-4 + slack
    assert compression_slack([{"outputs": first}], ["outputs"], "none", 256) == 0.0


# ---- the stage all-reduce ----

@pytest.mark.parametrize("codec", ["none", "fp16", "int8", "ternary"])
def test_a_robust_round_gradient_round_trips_and_tampering_is_refused(codec):
    from hivemind.compression import deserialize_torch_tensor

    from swarm.server.robust_allreduce import pack, unpack

    vector = activation(70_000)
    packed = pack(vector, codec, 256)
    parts = [deserialize_torch_tensor(chunk) for chunk in packed.chunks]
    assert torch.equal(unpack(parts, vector.numel(), packed.sha256, codec, 256), packed.vector)  # what the sender keeps
    assert torch.equal(packed.vector, vector) if codec == "none" else not torch.equal(packed.vector, vector)
    tampered = [parts[0].clone()] + parts[1:]
    tampered[0][0] += 1
    with pytest.raises(ValueError, match="signed hash"):
        unpack(tampered, vector.numel(), packed.sha256, codec, 256)
    if codec != "none":  # bytes that match their signed hash, of a gradient of another size than the round's
        longer = pack(torch.cat([vector, vector[:300]]), codec, 256)
        longer_parts = [deserialize_torch_tensor(chunk) for chunk in longer.chunks]
        with pytest.raises(ValueError, match="need|takes"):
            unpack(longer_parts, vector.numel(), longer.sha256, codec, 256)


def test_butterfly_int8_codec_round_trips_float64_parts_and_refuses_lies(monkeypatch):
    from hivemind.compression import CompressionInfo, Float16Compression, deserialize_torch_tensor
    from hivemind.compression import serialization

    from swarm.net.compression import CompressionError
    from swarm.server.averaging import BlockwiseInt8, _register_decoder, butterfly_compression

    assert isinstance(butterfly_compression("fp16"), Float16Compression)
    codec = butterfly_compression("int8", 128)
    part = activation(1000).double()
    serialized = codec.compress(part, CompressionInfo.from_tensor(part, key=0))
    assert len(serialized.buffer) == 1000 + 4 * 8  # a byte per value, a float32 scale per 128 values
    monkeypatch.setitem(serialization._BASE_COMPRESSION_TYPES, "BLOCKWISE_8BIT", None)  # restored afterwards
    _register_decoder(codec)
    decoded = deserialize_torch_tensor(serialized)  # as hivemind's receiver decodes a part, by its tag
    assert decoded.dtype == torch.float64 and decoded.shape == part.shape
    assert bool(((decoded - part).abs() <= error_bound(compress(part.float(), "int8", 128)).double()).all())
    for lie in (serialized.buffer[:-4], serialized.buffer[:-4] + b"\x00\x00\xc0\x7f"):  # short; a NaN scale
        with pytest.raises(CompressionError):
            codec.extract(type(serialized)(compression=serialized.compression, buffer=lie, size=serialized.size,
                                           dtype="float64"))
    assert isinstance(codec, BlockwiseInt8) and codec.estimate_compression_ratio(
        CompressionInfo.from_tensor(part)) == pytest.approx((8 + 32 / 128) / 64)


def test_under_int4_values_travel_in_4_bits_and_gradients_in_8():
    x = activation(64, 1024)
    message = msgpack.unpackb(encode({"outputs": x, "grad_inputs": x, "grad_outputs": x, "inputs": x}, "int4"))
    assert {key: message[key]["codec"] for key in message} == {"outputs": "int4", "inputs": "int4",
                                                              "grad_inputs": "int8", "grad_outputs": "int8"}
    assert gradient_codec("int4") == "int8" and gradient_codec("fp16") == "fp16" and gradient_codec("none") == "none"
