"""The wire format and the RPC layer against malformed, hostile and oversized input, with no network.

RPCServicer is exercised through its coroutines with fake handlers and a fake caller; call_peer
through a stand-in for hivemind's P2P that hands requests straight to an in-process servicer.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import msgpack
import pytest
import torch

from swarm.net.compression import CompressionError, compress, decompress
from swarm.net.rpc import KINDS, REPLY_HEADER, REQUEST_HEADER, EmptyStreamReply, RemoteError, RPCServicer, call_peer
from swarm.net.wire import (MAX_TENSOR_DIMS, MIN_COMPRESSED_ELEMENTS, WireError, decode, encode,
                        pack_compressed, pack_tensor, payload_size_hint, unpack_compressed, unpack_tensor)
from tests.utils.fuzzing import mutate, random_bytes, tensor_lies
from tests.utils.memory_stream import MemoryStreams


def lie(shape: Any, dtype: Any = "float32", data: Any = b"\x00" * 4) -> Dict[str, Any]:
    return {"__tensor__": True, "dtype": dtype, "shape": shape, "data": data}


# ---- wire ----

@pytest.mark.parametrize("shape", [
    [2**40, 2**40], [2**62, 2**62], [2**31, 2**31, 2**2], [2**64], [-1], [2, -2], [True], [1.0], [1.5], ["2"],
    [None], [[2]], [1] * (MAX_TENSOR_DIMS + 1), "12", 7, None, {"0": 1},
])
def test_shapes_that_are_not_sane_are_refused(shape):
    with pytest.raises(WireError, match="shape|size|exceeds"):
        unpack_tensor(lie(shape))


def test_overflowing_product_does_not_slip_past_the_byte_check():
    # 2**32 * 2**32 wraps to 0 in int64: with 0 bytes of data the old check would have passed
    with pytest.raises(WireError, match="exceeds the limit"):
        unpack_tensor(lie([2**32, 2**32], data=b""))
    with pytest.raises(WireError, match="exceeds the limit"):
        unpack_tensor(lie([0, 2**62], data=b""))  # a zero does not excuse an absurd size


def test_zero_sized_and_zero_dim_tensors_round_trip():
    for tensor in (torch.tensor(3.5), torch.tensor(7, dtype=torch.int64), torch.empty(0, 5), torch.empty(2, 0, 3)):
        out = decode(encode({"x": tensor}))["x"]
        assert out.shape == tensor.shape and out.dtype == tensor.dtype and torch.equal(out, tensor)
    scalar = decode(encode({"x": torch.tensor(2.0)}))["x"]
    assert scalar.ndim == 0 and scalar.item() == 2.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.uint8])
def test_every_dtype_round_trips_exactly_and_writably(dtype):
    tensor = (torch.randn(3, 4, 5) * 50).to(dtype)
    out = decode(encode({"x": tensor, "nested": [{"y": tensor[0]}]}))
    assert out["x"].dtype == dtype and torch.equal(out["x"], tensor)
    assert torch.equal(out["nested"][0]["y"], tensor[0])
    out["x"].add_(1)  # writable, and owned by the receiver: the source is untouched
    assert not torch.equal(out["x"], tensor)


def test_bfloat16_keeps_its_bits():
    tensor = torch.tensor([1.0, -2.5, 3.140625, float("inf"), 1e-30], dtype=torch.bfloat16)
    out = decode(encode({"x": tensor}))["x"]
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), tensor.view(torch.int16))


@pytest.mark.parametrize("dtype", ["float64", "complex64", "", None, 5, ["float32"], "FLOAT32", "bool"])
def test_unknown_dtype_names_are_refused(dtype):
    with pytest.raises(WireError, match="dtype"):
        unpack_tensor(lie([1], dtype=dtype))


def test_unsendable_dtype_is_refused_on_encode():
    with pytest.raises(WireError, match="cannot be sent"):
        pack_tensor(torch.zeros(2, dtype=torch.float64))


@pytest.mark.parametrize("data, expected", [
    (b"\x00" * 3, "needs 4 bytes, got 3"), (b"\x00" * 5, "needs 4 bytes, got 5"), (b"", "needs 4 bytes, got 0"),
    ("four", "must be bytes"), (None, "must be bytes"), ([0, 0, 0, 0], "must be bytes"),
])
def test_wrong_data_length_or_type_is_refused(data, expected):
    with pytest.raises(WireError, match=expected):
        unpack_tensor(lie([1], data=data))


def test_truncated_payloads_are_refused():
    payload = encode({"stage": 0, "inputs": torch.randint(0, 256, (2, 16)), "targets": torch.randn(2, 16, 32)})
    for cut in sorted({1, 2, 7, len(payload) // 3, len(payload) // 2, len(payload) - 1}):
        with pytest.raises(WireError):
            decode(payload[:cut])
    with pytest.raises(WireError, match="undecodable"):
        decode(payload + b"\x00")  # trailing bytes after a whole message


@pytest.mark.parametrize("payload", [
    msgpack.packb([1, 2, 3]), msgpack.packb("text"), msgpack.packb(7), msgpack.packb(None), msgpack.packb(b"raw"),
    b"", b"\xc1", msgpack.packb({1: 2}), msgpack.packb({(1, 2): 3}),
])
def test_non_map_messages_are_refused(payload):
    with pytest.raises(WireError, match="map|undecodable"):
        decode(payload)


def test_nested_garbage_is_refused_with_a_reason():
    deep = b"\x81\xa1x" + b"\x91" * 200 + b"\xc0"
    with pytest.raises(WireError, match="nests deeper"):
        decode(deep)
    with pytest.raises(WireError):
        decode(b"\x91" * 100_000 + b"\xc0")
    with pytest.raises(WireError, match="unsupported value"):
        decode(msgpack.packb({"x": msgpack.ExtType(5, b"boom")}))
    with pytest.raises(WireError, match="unsupported value"):
        decode(msgpack.packb({"x": msgpack.Timestamp(1, 0)}))
    with pytest.raises(WireError, match="expected a tensor"):
        decode(msgpack.packb({"x": {"__tensor__": "yes", "dtype": "float32", "shape": [], "data": b"\0" * 4}}))
    with pytest.raises(WireError, match="exceeds the limit"):
        decode(msgpack.packb({"a": [{"b": lie([2**40, 2**40])}]}))
    with pytest.raises(WireError, match="must be bytes"):
        decode("a string, not bytes")


def test_error_reasons_stay_short_for_huge_garbage():
    with pytest.raises(WireError) as error:
        unpack_tensor(lie(list(range(100_000))))
    assert len(str(error.value)) < 300


def test_oversized_message_is_refused_before_parsing():
    with pytest.raises(WireError, match="exceeds the limit of 100 bytes"):
        decode(encode({"x": b"\x00" * 200}), max_bytes=100)


def test_thousands_of_random_and_mutated_payloads_decode_or_raise_wire_error():
    rng = random.Random(1234)
    valid = [encode({"stage": 0, "inputs": torch.randint(0, 256, (2, 16))}),
             encode({"stage": 1, "micro_batch_id": "m", "inputs": torch.randn(2, 4, 8), "targets": torch.zeros(2, 4)}),
             encode({"nested": [{"t": torch.tensor(1.0)}, [1, 2.5, None, "s", b"b"]]})]
    outcomes = {"decoded": 0, "refused": 0}
    for i in range(4000):
        payload = random_bytes(rng, 300) if i % 2 else mutate(rng, rng.choice(valid))
        try:
            assert isinstance(decode(payload), dict)
            outcomes["decoded"] += 1
        except WireError:
            outcomes["refused"] += 1
    assert outcomes["decoded"] > 50 and outcomes["refused"] > 1000, outcomes  # both paths exercised


def test_every_generated_tensor_lie_is_refused():
    for name, obj in tensor_lies(random.Random(0)):
        with pytest.raises(WireError):
            unpack_tensor(obj)


# ---- compressed tensors ----

def golden_message() -> Dict[str, Any]:
    """Exactly representable values, so that the encoding does not depend on how torch computes them."""
    return {"stage": 1, "inputs": torch.arange(6, dtype=torch.int64).reshape(2, 3),
            "hidden": (torch.arange(80, dtype=torch.float32) / 16 - 2.5).reshape(2, 40),
            "half": (torch.arange(70) / 8).to(torch.bfloat16), "meta": [None, 2.5, "m", b"b"]}


def test_uncompressed_encoding_is_unchanged():
    payload = encode(golden_message())
    assert payload == encode(golden_message(), "none") == encode(golden_message(), "none", 1024)
    assert len(payload) == 684  # the encoding before compression existed, pinned by its digest
    assert hashlib.sha256(payload).hexdigest() == "224cf706b84c1ef9c800734daee04c1d3030c22f891cb611f7cd12b055d1f6f5"


@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_compressed_message_decodes_to_float32_of_the_right_shape(codec):
    hidden = torch.randn(4, 8, 33, generator=torch.Generator().manual_seed(0))
    message = {"hidden": hidden, "nested": [{"grad": hidden[0].to(torch.bfloat16)}], "small": torch.randn(3, 21)}
    payload = encode(message, codec, 64)
    assert b"__qtensor__" in payload
    out = decode(payload)
    assert out["hidden"].shape == hidden.shape and out["hidden"].dtype == torch.float32
    assert torch.allclose(out["hidden"], hidden, atol=hidden.abs().max().item() / 100)
    assert out["nested"][0]["grad"].dtype == torch.float32 and out["nested"][0]["grad"].shape == (8, 33)
    assert out["small"].numel() < MIN_COMPRESSED_ELEMENTS and torch.equal(out["small"], message["small"])
    out["hidden"].mul_(2)  # writable


@pytest.mark.parametrize("codec", ["int8", "fp16"])
def test_integer_tensors_in_a_compressed_message_are_untouched(codec):
    message = {"inputs": torch.randint(0, 50_000, (16, 128)),
               "targets": torch.randint(0, 9, (16, 128), dtype=torch.int32),
               "mask": torch.ones(16, 128, dtype=torch.uint8), "hidden": torch.randn(16, 128)}
    out = decode(encode(message, codec))
    for key in ("inputs", "targets", "mask"):
        assert out[key].dtype == message[key].dtype and torch.equal(out[key], message[key])


def test_a_compressed_tensor_is_sent_as_is_to_every_peer():
    c = compress(torch.randn(1000), "int8")
    first, second = encode({"x": c, "to": "a"}), encode({"x": c, "to": "b"}, "fp16")
    assert c.data in first and c.scales in first and c.data in second
    assert torch.equal(decode(first)["x"], decompress(c)) and torch.equal(decode(second)["x"], decompress(c))
    assert payload_size_hint({"x": c, "y": [torch.zeros(10)]}) == 1000 + 16 + 40


def test_bad_compression_arguments_and_unfaithful_tensors_are_refused_on_encode():
    with pytest.raises(CompressionError, match="codec"):
        encode({}, "int2")
    with pytest.raises(CompressionError, match="block size"):
        encode({}, "int8", 32)
    with pytest.raises(CompressionError, match="NaN or inf"):
        encode({"x": torch.full((100,), float("nan"))}, "int8")
    with pytest.raises(WireError, match="cannot be sent"):
        encode({"x": torch.zeros(100, dtype=torch.float64)}, "int8")


def qlie(**fields: Any) -> Dict[str, Any]:
    """A valid int8 entry of 100 ones in blocks of 64, with ``fields`` replaced."""
    entry = pack_compressed(compress(torch.ones(100), "int8", 64))
    entry.update(fields)
    return entry


def fp16_bits(*bits: int) -> bytes:
    return torch.tensor(list(bits) + [0] * (100 - len(bits)), dtype=torch.int16).numpy().tobytes()


def scales(*values: float) -> bytes:
    return torch.tensor(values, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize("fields, reason", [
    ({"codec": "int2"}, "unknown codec"), ({"codec": "int4"}, "int4 data of shape \\[100\\] needs 50 bytes, got 100"),
    ({"codec": "none"}, "unknown codec"), ({"codec": None}, "unknown codec"),
    ({"codec": ["int8"]}, "unknown codec"), ({"block_size": 63}, "block size"), ({"block_size": 4097}, "block size"),
    ({"block_size": 2**63}, "block size"), ({"block_size": -64}, "block size"), ({"block_size": "64"}, "block size"),
    ({"block_size": 64.0}, "block size"), ({"block_size": True}, "block size"), ({"block_size": None}, "block size"),
    ({"block_size": 128}, "need 4 bytes, got 8"), ({"data": b"\x01" * 99}, "needs 100 bytes, got 99"),
    ({"data": b"\x01" * 101}, "needs 100 bytes"), ({"data": "x" * 100}, "must be bytes"),
    ({"data": None}, "must be bytes"),
    ({"scales": b"\0" * 4}, "need 8 bytes, got 4"), ({"scales": b"\0" * 9}, "need 8 bytes"),
    ({"scales": [1.0, 1.0]}, "must be bytes"), ({"scales": scales(1.0, -1.0)}, "finite and non-negative"),
    ({"scales": scales(float("nan"), 1.0)}, "finite and non-negative"),
    ({"scales": scales(1.0, float("inf"))}, "finite and non-negative"),
    ({"scales": scales(3e38, 3e38)}, "NaN or inf"), ({"data": b"\x80" + b"\x01" * 99}, "codes must lie"),
    ({"codec": "fp16", "data": fp16_bits(0x7C00), "scales": b""}, "NaN or inf"),
    ({"codec": "fp16", "data": fp16_bits(0, -1024), "scales": b""}, "NaN or inf"),  # 0xFC00: -inf
    ({"codec": "fp16", "data": fp16_bits(0, 0, 0x7E00), "scales": b""}, "NaN or inf"),
    ({"codec": "fp16", "data": fp16_bits(1), "scales": scales(1.0, 1.0)}, "need 0 bytes"),
    ({"codec": "fp16"}, "needs 200 bytes"), ({"shape": [2**40, 2**40]}, "exceeds the limit"),
    ({"shape": [2**32, 2**32]}, "exceeds the limit"), ({"shape": [-100]}, "non-negative"), ({"shape": "100"}, "shape"),
    ({"shape": [1] * (MAX_TENSOR_DIMS + 1)}, "shape"), ({"shape": [10, 10.0]}, "non-negative"),
    ({"shape": [101]}, "needs 101 bytes"), ({"__qtensor__": 1}, "expected a compressed tensor"),
])
def test_malformed_compressed_entries_are_refused(fields, reason):
    with pytest.raises(WireError, match=reason):
        unpack_compressed(qlie(**fields))
    with pytest.raises(WireError, match=reason):
        decode(msgpack.packb({"a": [qlie(**fields)]}, use_bin_type=True))


def test_a_valid_compressed_entry_decodes():
    assert torch.equal(unpack_compressed(qlie()), torch.ones(100))
    fp16 = qlie(codec="fp16", data=torch.full((100,), 0.5, dtype=torch.float16).numpy().tobytes(), scales=b"")
    assert torch.equal(unpack_compressed(fp16), torch.full((100,), 0.5))


def test_mutated_compressed_payloads_decode_or_raise_wire_error():
    rng = random.Random(99)
    valid = [encode({"h": torch.randn(2, 70), "ids": torch.arange(5)}, "int8", 64),
             encode({"h": torch.randn(3, 30)}, "fp16"), encode({"c": compress(torch.zeros(200), "int8", 64)})]
    outcomes = {"decoded": 0, "refused": 0}
    for _ in range(1500):
        try:
            out = decode(mutate(rng, rng.choice(valid)))
            outcomes["decoded"] += 1
            for value in out.values():
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    assert bool(torch.isfinite(value).all())
        except WireError:
            outcomes["refused"] += 1
    assert outcomes["decoded"] > 20 and outcomes["refused"] > 500, outcomes


# ---- RPCServicer ----

class FakeCaller:
    """Stands in for a hivemind PeerID: the servicer only uses str(caller)."""

    def __init__(self, name: str):
        self.name = name

    def __str__(self) -> str:
        return self.name


async def _echo(message: Dict[str, Any], caller: str) -> Dict[str, Any]:
    return {"echo": message, "caller": caller}


def _raiser(error: Exception):
    async def handler(message: Dict[str, Any], caller: str) -> Dict[str, Any]:
        raise error
    return handler


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.mark.parametrize("error, kind", [
    (ValueError("v"), "bad_request"), (TypeError("t"), "bad_request"), (KeyError("k"), "bad_request"),
    (IndexError("i"), "bad_request"), (OverflowError("o"), "bad_request"), (WireError("w"), "bad_request"),
    (RemoteError("r", "wrong_stage"), "wrong_stage"), (RemoteError("r", "unavailable"), "unavailable"),
    (RuntimeError("bug"), "internal"), (ZeroDivisionError("bug"), "internal"),
])
def test_handler_errors_map_to_kinds_and_only_bugs_log_a_traceback(error, kind, caplog):
    servicer = RPCServicer({"m": _raiser(error)})
    with caplog.at_level(logging.DEBUG, logger="swarm.net.rpc"):
        reply = decode(run(servicer._dispatch("m", encode({}), FakeCaller("c1"))))
    assert reply["kind"] == kind and reply["error"]
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert len(tracebacks) == (1 if kind == "internal" else 0), caplog.text
    assert len(servicer.budget) == 0


@pytest.mark.parametrize("method, payload, expected", [
    ("nope", encode({}), "unknown method"), ("x" * 100_000, encode({}), "unknown method"),
    ("echo", b"\xc1garbage", "undecodable"), ("echo", msgpack.packb([1]), "must be a map"),
    ("echo", msgpack.packb({"t": lie([2**62, 2**62])}), "exceeds the limit"), ("echo", b"", "undecodable"),
])
def test_bad_input_is_answered_with_bad_request_and_no_traceback(method, payload, expected, caplog):
    servicer = RPCServicer({"echo": _echo})
    with caplog.at_level(logging.DEBUG, logger="swarm.net.rpc"):
        reply = decode(run(servicer._dispatch(method, payload, FakeCaller("c1"))))
    assert reply["kind"] == "bad_request" and expected in reply["error"], reply
    assert len(reply["error"]) < 1100
    assert not [r for r in caplog.records if r.exc_info]


def test_well_formed_request_reaches_the_handler_with_the_caller_id():
    servicer = RPCServicer({"echo": _echo})
    reply = decode(run(servicer._dispatch("echo", encode({"x": torch.arange(3)}), FakeCaller("12D3caller"))))
    assert reply["caller"] == "12D3caller" and torch.equal(reply["echo"]["x"], torch.arange(3))


def test_unencodable_reply_is_an_internal_error(caplog):
    async def bad_reply(message, caller):
        return {"x": object()}
    with caplog.at_level(logging.ERROR, logger="swarm.net.rpc"):
        reply = decode(run(RPCServicer({"m": bad_reply})._dispatch("m", encode({}), FakeCaller("c"))))
    assert reply["kind"] == "internal" and "unencodable" in reply["error"]


def test_concurrent_requests_over_the_per_caller_limit_are_busy():
    async def scenario():
        release = asyncio.Event()
        started = 0

        async def blocked(message, caller):
            nonlocal started
            started += 1
            await release.wait()
            return {"ok": True}

        servicer = RPCServicer({"m": blocked}, max_requests_per_caller=3)
        held = [asyncio.create_task(servicer._dispatch("m", encode({}), FakeCaller("greedy"))) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert started == 3 and servicer.budget.in_flight("greedy")[0] == 3
        over = decode(await asyncio.wait_for(servicer._dispatch("m", encode({}), FakeCaller("greedy")), 1.0))
        assert over["kind"] == "busy" and started == 3
        other = asyncio.create_task(servicer._dispatch("m", encode({}), FakeCaller("polite")))  # others unaffected
        await asyncio.sleep(0.01)
        assert started == 4
        release.set()
        replies = [decode(reply) for reply in await asyncio.gather(*held, other)]
        assert all(reply == {"ok": True} for reply in replies)
        assert len(servicer.budget) == 0  # bookkeeping released, nothing left behind
        after = decode(await servicer._dispatch("m", encode({}), FakeCaller("greedy")))
        assert after == {"ok": True}
    run(scenario())


def test_bytes_in_flight_over_the_per_caller_limit_are_busy():
    async def scenario():
        release = asyncio.Event()

        async def blocked(message, caller):
            await release.wait()
            return {"ok": True}

        servicer = RPCServicer({"m": blocked}, max_message_bytes=1000, max_bytes_per_caller=1500)
        payload = encode({"pad": b"\x00" * 800})
        first = asyncio.create_task(servicer._dispatch("m", payload, FakeCaller("c")))
        await asyncio.sleep(0.01)
        second = decode(await asyncio.wait_for(servicer._dispatch("m", payload, FakeCaller("c")), 1.0))
        assert second["kind"] == "busy" and "bytes" in second["error"]
        small = asyncio.create_task(servicer._dispatch("m", encode({}), FakeCaller("c")))
        await asyncio.sleep(0.01)
        release.set()
        assert decode(await first) == {"ok": True} and decode(await small) == {"ok": True}
        assert len(servicer.budget) == 0
    run(scenario())


def test_budget_is_released_when_the_handler_fails_or_is_cancelled():
    async def scenario():
        never = asyncio.Event()

        async def hang(message, caller):
            await never.wait()

        servicer = RPCServicer({"fail": _raiser(RuntimeError("x")), "hang": hang}, max_requests_per_caller=1)
        await servicer._dispatch("fail", encode({}), FakeCaller("c"))
        assert len(servicer.budget) == 0
        task = asyncio.create_task(servicer._dispatch("hang", encode({}), FakeCaller("c")))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(servicer.budget) == 0
    run(scenario())


def test_limits_that_would_refuse_every_large_message_are_rejected():
    with pytest.raises(ValueError, match="max_bytes_per_caller"):
        RPCServicer({}, max_message_bytes=1000, max_bytes_per_caller=999)
    with pytest.raises(ValueError, match="at least 1"):
        RPCServicer({}, max_requests_per_caller=0)


def test_unauthorized_callers_are_refused_and_logged_once_each(caplog):
    calls: List[str] = []

    async def handler(message, caller):
        calls.append(caller)
        return {"ok": True}

    servicer = RPCServicer({"m": handler}, authorize=lambda caller: caller.startswith("friend"))

    async def scenario():
        replies = []
        for caller in ["stranger1", "stranger1", "friend1", "stranger2", "stranger1"]:
            replies.append(decode(await servicer._dispatch("m", encode({}), FakeCaller(caller))))
        return replies

    with caplog.at_level(logging.WARNING, logger="swarm.net.rpc"):
        replies = run(scenario())
    assert [r.get("kind") for r in replies] == ["unauthorized", "unauthorized", None, "unauthorized", "unauthorized"]
    assert calls == ["friend1"]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and "stranger1" in warnings[0] and "stranger2" in warnings[1], warnings


def test_reported_unauthorized_callers_are_bounded():
    servicer = RPCServicer({}, authorize=lambda caller: False)
    for i in range(3000):
        servicer._refusal(f"c{i}")
    assert len(servicer._reported) <= 1024


def test_failing_authorize_is_an_internal_error_not_a_crash(caplog):
    def authorize(caller):
        raise RuntimeError("policy store down")
    with caplog.at_level(logging.ERROR, logger="swarm.net.rpc"):
        reply = decode(run(RPCServicer({"m": _echo}, authorize=authorize)._dispatch("m", encode({}), FakeCaller("c"))))
    assert reply["kind"] == "internal"


def test_kinds_are_documented():
    import swarm.net.rpc
    assert all(f"``{kind}``" in swarm.net.rpc.__doc__ for kind in KINDS)


# ---- streams and call_peer, through a stand-in for P2P ----

class LoopbackP2P:
    """Hands calls straight to an in-process servicer: unary ones as hivemind's StubBase makes them, streams
    through :class:`tests.utils.memory_stream.MemoryStreams`; ``tamper`` changes every reply's parts."""

    def __init__(self, servicer: RPCServicer, caller: str = "caller", tamper=None):
        self.servicer, self.caller, self.tamper = servicer, caller, tamper or (lambda chunks: chunks)
        self.streams = MemoryStreams(servicer, caller, self.tamper)

    async def call_protobuf_handler(self, peer, name, request, response_type):
        response = await self.servicer.rpc_unary(request, SimpleNamespace(remote_id=FakeCaller(self.caller)))
        return response_type(metadata=self.tamper([response.metadata])[0])

    async def call_binary_stream_handler(self, peer, name):
        return await self.streams.open()


def call(p2p: LoopbackP2P, method: str, message: Dict[str, Any], **kwargs) -> Dict[str, Any]:
    return run(call_peer(p2p, FakeCaller("server"), method, message, timeout=10, **kwargs))


def test_call_peer_round_trips_unary_and_stream():
    p2p = LoopbackP2P(RPCServicer({"echo": _echo}))
    big = torch.randn(600_000)  # 2.4 MB: goes as a stream, decoded off the event loop
    assert torch.equal(call(p2p, "echo", {"x": big})["echo"]["x"], big)
    assert call(p2p, "echo", {"x": 1}, stream=True)["echo"] == {"x": 1}
    assert call(p2p, "echo", {"x": 1})["caller"] == "caller"


def test_large_reply_to_a_unary_call_falls_back_to_a_stream():
    async def large(message, caller):
        return {"x": torch.zeros(1_200_000)}  # 4.8 MB > the unary reply limit
    assert call(LoopbackP2P(RPCServicer({"m": large})), "m", {})["x"].shape == (1_200_000,)


class DroppedReplies:
    """A tamper that loses the first ``count`` stream replies whole, as p2pd now and then does."""

    def __init__(self, count: int):
        self.count = count

    def __call__(self, chunks: List[bytes]) -> List[bytes]:
        if self.count > 0:
            self.count -= 1
            return []
        return chunks


def test_an_empty_stream_reply_is_asked_for_once_more_then_fails_the_call():
    served = []

    async def counted(message, caller):
        served.append(message["x"])
        return {"x": message["x"]}

    p2p = LoopbackP2P(RPCServicer({"m": counted}), tamper=DroppedReplies(1))
    assert call(p2p, "m", {"x": 7}, stream=True)["x"] == 7
    assert served == [7, 7]  # the server answered twice; the first answer was lost
    served.clear()
    with pytest.raises(EmptyStreamReply):
        call(LoopbackP2P(RPCServicer({"m": counted}), tamper=DroppedReplies(2)), "m", {"x": 8}, stream=True)
    assert served == [8, 8]


def test_oversized_replies_are_bad_reply_and_reading_stops_early():
    async def large(message, caller):
        return {"x": torch.zeros(1_500_000)}  # 6 MB

    p2p = LoopbackP2P(RPCServicer({"m": large}))
    with pytest.raises(RemoteError) as error:
        call(p2p, "m", {}, stream=True, max_reply_bytes=3 * 2**20)
    assert error.value.kind == "bad_reply" and "of 6000" in str(error.value)  # refused from the reply's header
    with pytest.raises(RemoteError) as error:
        call(LoopbackP2P(RPCServicer({"m": _echo})), "m", {"pad": b"\0" * 5000}, max_reply_bytes=1000)
    assert error.value.kind == "bad_reply"


@pytest.mark.parametrize("tamper", [
    lambda chunks: [chunk[: len(chunk) // 2] for chunk in chunks],
    lambda chunks: [b"\xc1" + chunk for chunk in chunks],
    lambda chunks: [msgpack.packb([1, 2])],
])
def test_undecodable_replies_are_bad_reply(tamper):
    for stream in (False, True):
        with pytest.raises(RemoteError) as error:
            call(LoopbackP2P(RPCServicer({"m": _echo}), tamper=tamper), "m", {"x": 1}, stream=stream)
        assert error.value.kind == "bad_reply"


def test_unknown_error_kinds_from_a_peer_become_internal():
    tamper = lambda chunks: [encode({"error": "x", "kind": "format_your_disk"})]  # noqa: E731
    with pytest.raises(RemoteError) as error:
        call(LoopbackP2P(RPCServicer({"m": _echo}), tamper=tamper), "m", {})
    assert error.value.kind == "internal"


def test_stream_requests_are_limited_per_message_and_per_caller():
    servicer = RPCServicer({"echo": _echo}, max_message_bytes=3 * 2**20, max_bytes_per_caller=3 * 2**20)
    p2p = LoopbackP2P(servicer)
    with pytest.raises(RemoteError, match="exceeds this peer's limit") as error:
        call(p2p, "echo", {"x": torch.zeros(1_000_000)})  # 4 MB message > 3 MiB
    assert error.value.kind == "bad_request"
    truncated = encode({"x": torch.zeros(600_000)})[: 2 * 2**20 + 100]
    reply = decode(run(exchange(MemoryStreams(servicer, "c"), frame("echo", truncated))))
    assert reply["kind"] == "bad_request" and "undecodable" in reply["error"]
    assert len(servicer.budget) == 0

    async def over_budget():
        servicer.budget.admit("c", 2 * 2**20)  # another request of the same caller holds 2 MiB
        try:  # answered from the header: the 3 MiB payload is never sent
            return decode(await exchange(MemoryStreams(servicer, "c"), frame("echo", b"", declared=3 * 2**20)))
        finally:
            servicer.budget.release("c", 2 * 2**20)
    assert run(over_budget())["kind"] == "busy"
    assert len(servicer.budget) == 0


def test_a_stream_that_ends_before_its_announced_payload_gets_no_answer_and_holds_nothing():
    servicer = RPCServicer({"echo": _echo})
    assert run(exchange(MemoryStreams(servicer, "c"), frame("echo", b"\0" * 100, declared=1000))) is None
    assert run(exchange(MemoryStreams(servicer, "c"), REQUEST_HEADER.pack(4, 10)[:5])) is None  # a cut header
    assert len(servicer.budget) == 0


def test_a_method_name_longer_than_the_limit_is_refused_from_the_header():
    servicer = RPCServicer({"echo": _echo})
    reply = decode(run(exchange(MemoryStreams(servicer, "c"), frame("m" * 300, b""))))
    assert reply["kind"] == "bad_request" and "method name" in reply["error"]


def frame(method: str, payload: bytes, declared: Optional[int] = None) -> bytes:
    """A binary stream request as swarm.net.rpc frames it; ``declared`` overrides the payload length it announces."""
    name = method.encode()
    return REQUEST_HEADER.pack(len(name), len(payload) if declared is None else declared) + name + payload


async def exchange(streams: MemoryStreams, data: bytes) -> Optional[bytes]:
    """Send ``data`` on a new stream and end it; the reply's payload, or None if the server sent none."""
    _, reader, writer = await streams.open()
    writer.write(data)
    writer.close()
    try:
        (size,) = REPLY_HEADER.unpack(await reader.readexactly(REPLY_HEADER.size))
        return await reader.readexactly(size)
    except asyncio.IncompleteReadError:
        return None
