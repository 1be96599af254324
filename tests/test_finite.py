"""all_finite agrees with the element-wise test, including where a sum alone would mislead."""

import pytest
import torch

from swarm.model.finite import all_finite


def _elementwise(t: torch.Tensor) -> bool:
    return bool(torch.isfinite(t).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_one_non_finite_value_anywhere_is_found(dtype, bad):
    for size in (1, 7, 64, 1000, 4099):  # vectorised bodies and scalar tails of the reduction
        for index in {0, size // 2, size - 1}:
            t = torch.randn(size).to(dtype)
            t[index] = bad
            assert not all_finite(t), (dtype, bad, size, index)
            assert not all_finite(t.reshape(1, size, 1))


def test_infinities_of_both_signs_are_found():
    assert not all_finite(torch.tensor([1.0, float("inf"), float("-inf"), 2.0]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_finite_values_whose_sum_overflows_are_finite(dtype):
    big = torch.finfo(dtype).max
    t = torch.full((1000,), big, dtype=dtype)
    assert not bool(torch.isfinite(t.sum()))  # the sum alone would call this tensor non-finite
    assert all_finite(t)
    assert all_finite(torch.cat([t, -t, t]))


def test_plain_tensors_empty_ones_and_non_floating_ones():
    assert all_finite(torch.randn(16, 128, 256))
    assert all_finite(torch.randn(33, 5).t())  # not contiguous
    assert all_finite(torch.empty(0))
    assert all_finite(torch.empty(0, 4, dtype=torch.float16))
    assert all_finite(torch.randint(0, 256, (4, 128)))
    assert all_finite(torch.tensor([True, False]))
    assert all_finite(torch.tensor(3.0))
    assert not all_finite(torch.tensor(float("nan")))


def test_agrees_with_the_elementwise_test_on_random_tensors():
    generator = torch.Generator().manual_seed(0)
    for trial in range(200):
        size = int(torch.randint(0, 300, (1,), generator=generator))
        t = torch.randn(size, generator=generator) * float(10 ** torch.randint(-3, 39, (1,), generator=generator))
        if size and trial % 3 == 0:
            positions = torch.randint(0, size, (int(torch.randint(1, 4, (1,), generator=generator)),), generator=generator)
            t[positions] = float(("nan", "inf", "-inf")[trial // 3 % 3])
        assert all_finite(t) == _elementwise(t), trial
