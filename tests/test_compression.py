"""Blockwise int8 and int4 and float16 compression: error bounds block by block, edge sizes, refusals,
determinism."""

from __future__ import annotations

import math

import pytest
import torch

from swarm.net.compression import (DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, Compressed, CompressionError,
                               compress, decompress, error_bound, num_blocks)
from swarm.net.wire import encode


def varied_magnitudes(numel: int, block_size: int, seed: int = 0) -> torch.Tensor:
    """Random values whose blocks span twelve orders of magnitude, so each block's bound differs."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    exponents = torch.arange(num_blocks(numel, block_size)) % 13 - 6
    return values * (10.0 ** exponents).repeat_interleave(block_size)[:numel]


def block_max(values: torch.Tensor, block_size: int) -> torch.Tensor:
    """The largest magnitude in each block of a flat float64 tensor (padding with zeros changes no maximum)."""
    padding = num_blocks(values.numel(), block_size) * block_size - values.numel()
    return torch.cat([values.abs(), values.new_zeros(padding)]).view(-1, block_size).amax(dim=1)


def assert_within_block_bounds(original: torch.Tensor, c: Compressed) -> None:
    """Each block's largest error is at most absmax / 254 of that block, up to float32 rounding.

    Blocks whose largest value is below 127 * 2**-126 share the smallest step, 2**-126.
    """
    exact = original.detach().reshape(-1).to(torch.float64)
    error = (decompress(c).reshape(-1).to(torch.float64) - exact).abs()
    allowed = block_max(exact, c.block_size).clamp_min(127 * 2.0**-126) / 254 * (1 + 2**-13)
    worst = block_max(error, c.block_size)
    assert bool((worst <= allowed).all()), (worst - allowed).max()
    assert bool((error <= error_bound(c).reshape(-1).to(torch.float64)).all())


@pytest.mark.parametrize("block_size", [MIN_BLOCK_SIZE, DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE])
@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000, 3 * DEFAULT_BLOCK_SIZE + 17, 2 * MAX_BLOCK_SIZE + 5])
def test_int8_error_stays_within_each_blocks_bound(numel, block_size):
    tensor = varied_magnitudes(numel, block_size)
    c = compress(tensor, "int8", block_size)
    out = decompress(c)
    assert out.shape == tensor.shape and out.dtype == torch.float32
    assert len(c.data) == numel and len(c.scales) == 4 * math.ceil(numel / block_size)
    assert_within_block_bounds(tensor, c)


def test_small_blocks_keep_their_precision_beside_an_outlier():
    tensor = torch.full((4, 256), 1e-3)
    tensor[0, 0] = 1e6
    out = decompress(compress(tensor, "int8"))
    assert out[0, 1:].abs().max() < 1e6 / 254  # the outlier's block is coarse
    assert torch.allclose(out[1:], tensor[1:], rtol=0, atol=1e-3 / 254)  # the others are not


def test_scales_are_absmax_over_127_and_zero_blocks_stay_exact():
    tensor = torch.cat([torch.zeros(64), torch.linspace(-3, 2, 64), torch.zeros(10)])
    c = compress(tensor, "int8", 64)
    scales = torch.frombuffer(bytearray(c.scales), dtype=torch.float32)
    assert scales.tolist() == [0.0, pytest.approx(3 / 127), 0.0]
    out = decompress(c)
    assert torch.equal(out[:64], torch.zeros(64)) and torch.equal(out[128:], torch.zeros(10))
    assert out[64] == -3  # the largest value of a block is exact up to float32 rounding


def test_tiny_and_huge_magnitudes_keep_the_bound():
    uniform = torch.rand(500, generator=torch.Generator().manual_seed(1)) * 2 - 1
    for magnitude in (1e-44, 1e-40, 1e-38, 1e-30, 1e30, 1e38, 3e38):
        tensor = uniform * magnitude
        c = compress(tensor, "int8", 64)
        assert bool(torch.isfinite(decompress(c)).all())
        assert_within_block_bounds(tensor, c)


def test_values_at_float32s_limit_are_refused_for_int8():
    with pytest.raises(CompressionError, match="largest"):
        compress(torch.full((64,), torch.finfo(torch.float32).max), "int8")


@pytest.mark.parametrize("numel", [1, 63, 64, 65, 1000])
def test_fp16_round_trip_is_a_float16_cast(numel):
    tensor = varied_magnitudes(numel, 64).clamp(-6e4, 6e4)
    c = compress(tensor, "fp16")
    out = decompress(c)
    assert out.dtype == torch.float32 and out.shape == tensor.shape and len(c.data) == 2 * numel and c.scales == b""
    assert torch.equal(out, tensor.half().float())
    assert bool(((out - tensor).abs() <= error_bound(c)).all())


@pytest.mark.parametrize("codec", ["int8", "int4", "fp16"])
@pytest.mark.parametrize("shape", [(0,), (0, 5), (2, 0, 3), ()])
def test_empty_and_zero_dim_tensors_round_trip(codec, shape):
    tensor = torch.full(shape, 1.5)
    out = decompress(compress(tensor, codec))
    assert out.shape == tensor.shape and out.dtype == torch.float32 and torch.equal(out, tensor)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    tensor = varied_magnitudes(700, 64).clamp(-6e4, 6e4).to(dtype)
    c = compress(tensor, "int8", 64)
    assert decompress(c).dtype == torch.float32
    assert_within_block_bounds(tensor.float(), c)
    assert torch.equal(decompress(compress(tensor, "fp16")), tensor.float().half().float())


def test_non_contiguous_input():
    tensor = varied_magnitudes(64 * 30, 64).view(64, 30).t()
    c = compress(tensor, "int8", 64)
    assert decompress(c).shape == (30, 64)
    assert_within_block_bounds(tensor, c)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp16"])
def test_same_input_gives_the_same_bytes(codec):
    tensor = varied_magnitudes(5000, 256, seed=7).clamp(-6e4, 6e4)
    first, second = compress(tensor, codec), compress(tensor.clone(), codec)
    assert first == second and first.data == second.data and first.scales == second.scales


def test_decoded_tensor_is_writable_and_owned():
    c = compress(torch.ones(100), "int8", 64)
    out = decompress(c)
    out.add_(1)
    assert torch.equal(decompress(c), torch.ones(100))


@pytest.mark.parametrize("block_size", [0, -1, 1, MIN_BLOCK_SIZE - 1, MAX_BLOCK_SIZE + 1, 2**40, 64.0, True, "256",
                                        None])
def test_block_sizes_out_of_range_are_refused(block_size):
    with pytest.raises(CompressionError, match="block size"):
        compress(torch.ones(100), "int8", block_size)


@pytest.mark.parametrize("codec", ["int8", "int4", "fp16"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused(codec, bad):
    tensor = torch.ones(300)
    tensor[170] = bad
    with pytest.raises(CompressionError, match="NaN or inf"):
        compress(tensor, codec)


@pytest.mark.parametrize("value", [65520.0, -70000.0, 1e10])
def test_fp16_overflow_is_refused(value):
    tensor = torch.zeros(100)
    tensor[3] = value
    with pytest.raises(CompressionError, match="float16's range"):
        compress(tensor, "fp16")


def test_fp16_keeps_its_largest_value():
    tensor = torch.tensor([65504.0, -65504.0] * 40)
    assert torch.equal(decompress(compress(tensor, "fp16")), tensor)


@pytest.mark.parametrize("codec", ["none", "int2", "", None, "INT8"])
def test_codecs_other_than_fp16_int8_and_int4_are_refused(codec):
    with pytest.raises(CompressionError, match="codec"):
        compress(torch.ones(100), codec)


@pytest.mark.parametrize("tensor", [torch.ones(100, dtype=torch.float64), torch.arange(100), [1.0] * 100])
def test_only_float_tensors_are_compressed(tensor):
    with pytest.raises(CompressionError, match="can be compressed"):
        compress(tensor, "int8")


def test_inconsistent_compressed_fields_are_refused():
    good = compress(torch.ones(100), "int8", 64)
    with pytest.raises(CompressionError, match="needs 100 bytes"):
        Compressed("int8", (100,), 64, good.data[:-1], good.scales)
    with pytest.raises(CompressionError, match="need 8 bytes"):
        Compressed("int8", (100,), 64, good.data, good.scales + b"\0")
    with pytest.raises(CompressionError, match="need 0 bytes"):
        Compressed("fp16", (50,), 64, good.data, good.scales)
    with pytest.raises(CompressionError, match="non-negative"):
        decompress(Compressed("int8", (100,), 64, good.data, torch.tensor([1.0, -1.0]).numpy().tobytes()))


@pytest.mark.parametrize("codec, ratio", [("int8", 3.9), ("int4", 7.5), ("fp16", 1.9)])
def test_an_activation_shrinks_on_the_wire(codec, ratio):
    activation = torch.randn(64, 1024, generator=torch.Generator().manual_seed(0))
    plain, small = encode({"hidden": activation}), encode({"hidden": activation}, codec)
    assert len(plain) / len(small) >= ratio, (len(plain), len(small))


# ---- int4 ----

@pytest.mark.parametrize("block_size", [MIN_BLOCK_SIZE, DEFAULT_BLOCK_SIZE, MAX_BLOCK_SIZE])
@pytest.mark.parametrize("numel", [1, 2, 63, 64, 65, 1000, 3 * DEFAULT_BLOCK_SIZE + 17, 2 * MAX_BLOCK_SIZE + 5])
def test_int4_error_stays_within_a_seventh_of_each_blocks_largest_value(numel, block_size):
    tensor = varied_magnitudes(numel, block_size)
    c = compress(tensor, "int4", block_size)
    out = decompress(c)
    assert out.shape == tensor.shape and out.dtype == torch.float32
    assert len(c.data) == math.ceil(numel / 2) and len(c.scales) == 4 * math.ceil(numel / block_size)
    exact = tensor.reshape(-1).to(torch.float64)
    error = (out.reshape(-1).to(torch.float64) - exact).abs()
    allowed = block_max(exact, block_size).clamp_min(7 * 2.0**-126) / 7 * (1 + 2**-13)
    assert bool((block_max(error, block_size) <= allowed).all())
    assert bool((error <= error_bound(c).reshape(-1).to(torch.float64)).all())


def test_int4_rounding_is_unbiased_where_nearest_rounding_is_not():
    values = torch.full((4096,), 3.5)  # half-way between two codes once the block's largest value is 7
    values[::256] = 7.0
    decoded = decompress(compress(values, "int4", 256))
    rest = torch.ones(4096, dtype=torch.bool)
    rest[::256] = False
    assert abs(float(decoded[rest].mean()) - 3.5) < 0.05  # nearest rounding would send every one as 4
    assert set(decoded[rest].tolist()) == {3.0, 4.0}
    small = torch.full((4096,), 0.3)  # below half a step: nearest rounding would send zeros
    small[::256] = 7.0
    assert abs(float(decompress(compress(small, "int4", 256))[rest].mean()) - 0.3) < 0.05


def test_int4_keeps_zeros_signs_and_the_extremes_exact():
    tensor = torch.tensor([0.0, 7.0, -7.0, 1.0, -1.0, 0.0, 3.0])
    c = compress(tensor, "int4", MIN_BLOCK_SIZE)
    assert torch.equal(decompress(c), tensor)
    assert torch.equal(decompress(compress(torch.zeros(65), "int4", 64)), torch.zeros(65))
    huge = compress(torch.tensor([3e38, -3e38, 1.0]), "int4", 64)
    assert bool(((decompress(huge) - torch.tensor([3e38, -3e38, 1.0])).abs() <= error_bound(huge)).all())


def test_int4_keeps_float32s_largest_finite_and_refuses_non_finite_values():
    largest = compress(torch.full((64,), torch.finfo(torch.float32).max), "int4", 64)  # max / 7 * 7 stays finite
    assert bool(torch.isfinite(decompress(largest)).all())
    with pytest.raises(CompressionError, match="NaN or inf"):
        compress(torch.tensor([1.0, float("nan")]), "int4")


def test_malformed_int4_is_refused():
    good = compress(torch.arange(5, dtype=torch.float32), "int4", 64)  # 3 bytes, the last padded
    with pytest.raises(CompressionError, match="needs 3 bytes"):
        Compressed("int4", (5,), 64, good.data + b"\x88", good.scales)
    with pytest.raises(CompressionError, match=r"codes must lie in \[-7, 7\]"):
        decompress(Compressed("int4", (5,), 64, b"\x08" + good.data[1:], good.scales))  # a nibble of 0: code -8
    with pytest.raises(CompressionError, match="pad its last byte with a zero code"):
        decompress(Compressed("int4", (5,), 64, good.data[:2] + bytes([good.data[2] & 15 | 0x90]), good.scales))
