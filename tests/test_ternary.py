"""The all-reduce's ternary codec: its stated error on random and adversarial gradients, malformed data
refused, and most of a gradient sent (nothing is carried into the next step)."""

from __future__ import annotations

import pytest
import torch

from swarm.net.compression import CompressionError
from swarm.net.ternary import (TERNARY_BLOCK, THRESHOLD, check_gradient_codec, decode_ternary,
                               encode_ternary, ternary_bytes)

BFLOAT16_ROUNDING = 2.0**-8  # relative error of a scale rounded to bfloat16
BFLOAT16_SUBNORMAL_STEP = 2.0**-133  # its absolute error below bfloat16's smallest normal (as float32's, 2**-126)


def _within_stated_error(vector: torch.Tensor) -> None:
    """In each block, a value above THRESHOLD x the block's mean magnitude comes back as its sign times the mean
    magnitude of those values (the scale, rounded to bfloat16), and every other value as 0."""
    data = encode_ternary(vector)
    decoded = decode_ternary(data, vector.numel())
    assert len(data) == ternary_bytes(vector.numel()) and decoded.dtype == torch.float32
    for start in range(0, vector.numel(), TERNARY_BLOCK):
        block = vector[start : start + TERNARY_BLOCK].double()
        got = decoded[start : start + TERNARY_BLOCK].double()
        magnitude = block.abs()
        padded_mean = magnitude.sum() / TERNARY_BLOCK  # the last block is padded with zeros
        sent = magnitude > THRESHOLD * padded_mean
        assert torch.equal(got != 0, sent) or float(magnitude[sent].sum()) == 0.0
        if bool(sent.any()):
            scale = float(magnitude[sent].mean())
            assert torch.allclose(got[sent], torch.sign(block[sent]) * scale, rtol=BFLOAT16_ROUNDING,
                                  atol=BFLOAT16_SUBNORMAL_STEP)


@pytest.mark.parametrize("size", [1, 63, 64, 65, 1000, 4096 + 17])
def test_random_gradients_round_trip_within_the_stated_error(size):
    _within_stated_error(torch.randn(size, generator=torch.Generator().manual_seed(size)))


def test_zeros_huge_values_and_one_outlier_round_trip():
    _within_stated_error(torch.zeros(1000))
    huge = torch.full((600,), 3.0e38)
    huge[::2] = -3.0e38
    _within_stated_error(huge)
    tiny = torch.full((100,), 1e-40)  # subnormal float32 values
    _within_stated_error(tiny)
    outlier = torch.randn(128, generator=torch.Generator().manual_seed(1)) * 1e-3
    outlier[7] = 1e6  # coarsens its own block only: the next block keeps its small values' scale
    decoded = decode_ternary(encode_ternary(outlier), 128)
    assert float(decoded[7]) == pytest.approx(1e6, rel=BFLOAT16_ROUNDING)
    assert 0 < float(decoded[64:].abs().max()) < 1e-2


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradients_are_refused(value):
    vector = torch.ones(300)
    vector[5] = value
    with pytest.raises(CompressionError, match="NaN or inf"):
        encode_ternary(vector)


def test_the_encoding_is_17x_smaller_than_float32():
    size = 1 << 20
    assert 4 * size / ternary_bytes(size) == pytest.approx(17.07, rel=0.01)
    assert ternary_bytes(0) == 0 and decode_ternary(b"", 0).numel() == 0


def test_gradients_travel_only_in_known_codecs():
    assert [check_gradient_codec(c) for c in ("none", "fp16", "int8", "ternary")] == ["none", "fp16", "int8", "ternary"]
    for codec in ("int4", "", None):
        with pytest.raises(ValueError, match="gradients travel in one of"):
            check_gradient_codec(codec)


def test_malformed_data_is_refused():
    size = 100  # 2 blocks, the last one 36 values long
    data = bytearray(encode_ternary(torch.randn(size, generator=torch.Generator().manual_seed(0))))
    digits = 4  # after the two bfloat16 scales
    with pytest.raises(CompressionError, match="takes"):
        decode_ternary(bytes(data[:-1]), size)
    bad = bytearray(data)
    bad[0:2] = torch.tensor([float("nan")], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(CompressionError, match="scales"):
        decode_ternary(bytes(bad), size)
    bad = bytearray(data)
    bad[2:4] = torch.tensor([-1.0], dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    with pytest.raises(CompressionError, match="scales"):
        decode_ternary(bytes(bad), size)
    bad = bytearray(data)
    bad[digits] = 243
    with pytest.raises(CompressionError, match="243"):
        decode_ternary(bytes(bad), size)
    bad = bytearray(data)
    bad[digits + 12] = 3**4  # the fifth digit of a block's last byte: a 65th value
    with pytest.raises(CompressionError, match="beyond the end"):
        decode_ternary(bytes(bad), size)
    bad = bytearray(data)
    bad[digits + 13 + 7] = 3**1  # a digit of the 37th value of the last block: past the vector's end
    with pytest.raises(CompressionError, match="beyond the end"):
        decode_ternary(bytes(bad), size)


def test_most_of_a_gaussian_gradient_goes_out_and_the_decoded_one_points_the_same_way():
    """What the encoding drops is not sent later, so most coordinates must get their update: at the threshold of
    0.3 x the block's mean magnitude about 81% of a Gaussian gradient's values go out (2 (1 - Phi(0.3 sqrt(2 / pi))));
    at 0.7 only 58% would. The decoded gradient still points where the true one does (cosine about 0.86)."""
    gradient = torch.randn(TERNARY_BLOCK * 1000, generator=torch.Generator().manual_seed(0))
    decoded = decode_ternary(encode_ternary(gradient), gradient.numel())
    assert 0.79 < float((decoded != 0).float().mean()) < 0.83
    assert float(torch.nn.functional.cosine_similarity(gradient, decoded, dim=0)) > 0.85
    assert float((decoded - gradient).norm() / gradient.norm()) < 0.52
