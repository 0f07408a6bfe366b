"""ampgraph/runtime/cpu/blocked.py: products cast a block of the fp32 weight at a time into a
pooled scratch, with aten's values on the whole cast weight."""

from __future__ import annotations

import pytest
import torch

import ampgraph.runtime.cpu.blocked as blocked

LOW = torch.bfloat16


class Pool:
    """Hands out fresh scratch tensors and records what was asked for."""

    def __init__(self) -> None:
        self.asked: list[tuple[tuple, torch.dtype]] = []

    def __call__(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.asked.append((tuple(shape), dtype))
        return torch.full(shape, float("nan"), dtype=dtype, device=device)  # stale contents


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


@pytest.fixture
def small_scratch(monkeypatch):
    monkeypatch.setattr(blocked, "SCRATCH_NUMEL", 48)  # a (10, 8) weight in blocks of 6 rows


@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_aten_on_the_cast_weight(small_scratch, bias):
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 8).to(LOW), torch.randn(10, 8)
    b = torch.randn(10).to(LOW) if bias else None
    pool = Pool()
    got = blocked.linear(x, w, b, pool)
    close(got, torch.nn.functional.linear(x, w.to(LOW), b))
    assert pool.asked == [((6, 8), LOW)]  # one scratch of at most SCRATCH_NUMEL elements


def test_grad_input_matches_aten_on_the_cast_weight(small_scratch):
    torch.manual_seed(0)
    grad, w = torch.randn(5, 10).to(LOW), torch.randn(10, 64)
    pool = Pool()
    got = blocked.grad_input(grad, w, pool)
    close(got, grad @ w.to(LOW))
    # a quarter of the columns at least per block: 160 elements, 16 columns of 10 rows
    assert pool.asked == [((10, 16), LOW)]


@pytest.mark.parametrize("into", [False, True])
def test_weight_grad_matches_aten_and_fills_the_given_buffer(small_scratch, into):
    torch.manual_seed(0)
    grad, x = torch.randn(7, 10).to(LOW), torch.randn(7, 8).to(LOW)
    out = torch.empty(10, 8) if into else None
    pool = Pool()
    got = blocked.weight_grad(grad, x, torch.float32, out, pool)
    close(got, (grad.t() @ x).float())
    assert (got is out) if into else got.dtype == torch.float32
    assert pool.asked == [((6, 8), LOW)]


def test_a_weight_smaller_than_the_scratch_is_one_block():
    torch.manual_seed(0)
    x, w = torch.randn(4, 8).to(LOW), torch.randn(3, 8)
    pool = Pool()
    torch.testing.assert_close(blocked.linear(x, w, None, pool),
                               torch.nn.functional.linear(x, w.to(LOW)), rtol=0, atol=0)
    assert pool.asked == [((3, 8), LOW)]
