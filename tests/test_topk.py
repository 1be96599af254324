"""The all-reduce's top-k codec: its stated error on random and adversarial gradients, malformed data
refused, and error feedback that sends every coordinate eventually."""

from __future__ import annotations

import pytest
import torch

from swarm.net.compression import CompressionError
from swarm.net.topk import TOPK_BLOCK, ErrorFeedback, decode_topk, encode_topk, topk_bytes


def _within_stated_error(vector: torch.Tensor, k: int) -> None:
    """Of each block at most ``k`` values travel, each within half its block's int8 step; a value that does not
    travel is no larger than the block's k-th largest magnitude."""
    encoded = encode_topk(vector, k)
    decoded = decode_topk(encoded.data, vector.numel(), k)
    assert len(encoded.data) == topk_bytes(vector.numel(), k)
    for start in range(0, vector.numel(), TOPK_BLOCK):
        block, got = vector[start : start + TOPK_BLOCK], decoded[start : start + TOPK_BLOCK]
        magnitudes = block.abs().sort(descending=True).values
        kth = float(magnitudes[min(k, block.numel()) - 1])
        half_step = float(magnitudes[0]) / 127 / 2 * (1 + 1e-6)
        sent = got != 0
        assert int(sent.sum()) <= k
        assert torch.all((got[sent] - block[sent]).abs() <= half_step)
        assert torch.all(block[~sent].abs() <= max(kth, half_step))


@pytest.mark.parametrize("size", [1, 255, 256, 1000, 4096 + 17])
@pytest.mark.parametrize("k", [1, 8, 16, 128])
def test_random_gradients_round_trip_within_the_stated_error(size, k):
    _within_stated_error(torch.randn(size, generator=torch.Generator().manual_seed(size + k)), k)


def test_zeros_huge_values_and_one_outlier_round_trip():
    _within_stated_error(torch.zeros(1000), 16)
    huge = torch.full((600,), 3.0e38)
    huge[::2] = -3.0e38
    _within_stated_error(huge, 16)
    outlier = torch.randn(512, generator=torch.Generator().manual_seed(1)) * 1e-3
    outlier[7] = 1e6  # coarsens its own block only
    decoded = decode_topk(encode_topk(outlier, 16).data, 512, 16)
    assert float(decoded[7]) == pytest.approx(1e6, rel=1e-2)
    second = outlier[256:]
    assert torch.allclose(decoded[256:][decoded[256:] != 0], second[decoded[256:] != 0], rtol=0.01, atol=1e-7)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_gradients_are_refused(value):
    vector = torch.ones(300)
    vector[5] = value
    with pytest.raises(CompressionError, match="NaN or inf"):
        encode_topk(vector, 8)


def test_the_encoding_is_28x_smaller_than_float32_at_16_a_block():
    size = 1 << 20
    assert 4 * size / topk_bytes(size, 16) == pytest.approx(28.4, rel=0.01)
    assert 4 * size / topk_bytes(size, 8) >= 51


def _fields(data: bytes, blocks: int, k: int):
    return bytearray(data), 4 * blocks, (4 + k) * blocks


def test_malformed_data_is_refused():
    size, k = 600, 4  # 3 blocks, the last one 88 values long
    data = encode_topk(torch.randn(size, generator=torch.Generator().manual_seed(0)), k).data
    with pytest.raises(CompressionError, match="takes"):
        decode_topk(data[:-1], size, k)
    raw, positions, codes = _fields(data, 3, k)
    bad = bytearray(raw)
    bad[0:4] = torch.tensor([float("nan")]).numpy().tobytes()
    with pytest.raises(CompressionError, match="scales"):
        decode_topk(bytes(bad), size, k)
    bad = bytearray(raw)
    bad[positions + 1] = bad[positions]  # a position repeated
    with pytest.raises(CompressionError, match="rise strictly"):
        decode_topk(bytes(bad), size, k)
    bad = bytearray(raw)
    bad[codes] = 0x80  # -128
    with pytest.raises(CompressionError, match="codes"):
        decode_topk(bytes(bad), size, k)
    bad = bytearray(raw)
    bad[positions + 2 * k + k - 1] = 255  # the last block's last position beyond the vector's end
    bad[codes + 2 * k + k - 1] = 5
    with pytest.raises(CompressionError, match="beyond the end"):
        decode_topk(bytes(bad), size, k)


def test_error_feedback_sends_every_coordinate_and_tracks_the_sum():
    """A constant gradient whose small coordinates top-k never picks on their own: with the residual added
    back they travel too, and what was sent over many steps stays within one step's residual of the truth."""
    gradient = torch.linspace(0.1, 1.0, 512)
    feedback, sent_total = ErrorFeedback(), torch.zeros(512)
    for _ in range(200):
        prepared = feedback.prepare(gradient)
        sent = decode_topk(encode_topk(prepared, 16).data, 512, 16)
        feedback.settle(prepared, sent)
        sent_total += sent
    assert bool((sent_total > 0).all())  # every coordinate went out at least once
    assert torch.allclose(sent_total + feedback.residual, 200 * gradient, rtol=1e-4, atol=1e-3)
    plain = decode_topk(encode_topk(gradient, 16).data, 512, 16)
    assert int((plain != 0).sum()) == 32  # without feedback the same 32 coordinates, every time
