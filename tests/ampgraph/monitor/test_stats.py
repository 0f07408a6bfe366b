"""ampgraph/monitor/stats.py: the per-tensor statistics measured on the device."""

from __future__ import annotations

import math

import pytest
import torch

from ampgraph.monitor.stats import Plan, limits, merge, tensor_stats

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.mark.parametrize("small", [1 << 16, 1, 10**6])  # batched, one by one, mixed
def test_tensor_stats_match_torch(small):
    torch.manual_seed(0)
    ts = [torch.randn(1000) * 1e-3 + 1.0, torch.randn(37, 11) * 1e-6, torch.zeros(5),
          torch.tensor([1.0, 0.0, 1e-7, -2.0, 1e5]), torch.randn(3000)]
    lim = limits(torch.float16)
    plan = Plan([t.numel() for t in ts], torch.device("cpu"), small=min(small, 2000), chunk=1100)
    rows = tensor_stats(ts, plan, torch.tensor(4.0), lim).tolist()
    assert sorted(plan.order) == list(range(len(ts)))
    for row, i in zip(rows, plan.order):
        t = ts[i].double()
        got = merge([row], [t.numel()])
        nonzero = t[t != 0].abs()
        assert got["mean"] == pytest.approx(t.mean().item(), rel=1e-5, abs=1e-12)
        assert got["std"] == pytest.approx(t.std(unbiased=False).item(), rel=1e-4, abs=1e-12)
        assert got["norm"] == pytest.approx(t.norm().item(), rel=1e-5, abs=1e-12)
        expected = (nonzero * 4 < 2**-14).double().mean().item() if nonzero.numel() else 0.0
        assert got["underflow_rate"] == pytest.approx(expected)
        assert got["overflow_count"] == int((t.abs() * 4 > 65504).sum())
        assert got["min_abs"] == pytest.approx(nonzero.min().item() if nonzero.numel() else 0)
        assert got["max_abs"] == pytest.approx(t.abs().max().item())
    # a layer of two tensors pools them; a non-finite value voids the moments, is counted
    both = merge([rows[plan.order.index(0)], rows[plan.order.index(4)]], [1000, 3000])
    assert both["std"] == pytest.approx(torch.cat([ts[0], ts[4]]).std(unbiased=False).item(),
                                        rel=1e-4)
    bad = [torch.tensor([math.inf, 1.0, 0.0, -math.nan])]
    got = merge(tensor_stats(bad, Plan([4], torch.device("cpu")), 1.0, lim).tolist(), [4])
    assert got["overflow_count"] == 2 and got["mean"] is None and got["norm"] is None
    assert got["zero_frac"] == 0.25


def test_limits_are_the_low_dtypes_range():
    fp16, bf16 = limits(torch.float16), limits(torch.bfloat16)
    assert (fp16.name, fp16.tiny, fp16.max) == ("fp16", 2.0**-14, 65504.0)
    assert (bf16.name, bf16.tiny) == ("bf16", 2.0**-126)
    assert bf16.max == pytest.approx(3.3895e38, rel=1e-4)


def test_plan_measures_large_tensors_alone_and_chunks_small_ones():
    plan = Plan([10, 100, 5, 20, 60], torch.device("cpu"), small=50, chunk=25)
    assert plan.large == [1, 4]
    assert plan.chunks == [[0, 2], [3]]  # 10 + 5 fit a chunk of 25; 20 more would not
    assert plan.order == [1, 4, 0, 2, 3] and plan.totals == [15, 20]
    assert [t.tolist() for t in plan.lengths] == [[10, 5], [20]]


@pytest.mark.parametrize("small", [1, 100])  # measured alone, batched
def test_underflow_and_overflow_are_judged_at_the_loss_scale(small):
    t = [torch.tensor([0.0, 1e-6, 1e-3, 700.0, -800.0])]
    rows = tensor_stats(t, Plan([5], torch.device("cpu"), small=small), 100.0,
                        limits(torch.float16)).tolist()
    got = merge(rows, [5])
    # at scale 100: 1e-6 x 100 = 1e-4 is above fp16's smallest normal (6.1e-5), and
    # 700 x 100, 800 x 100 exceed its 65504
    assert got["overflow_count"] == 2 and got["zero_frac"] == 0.2
    assert got["underflow_rate"] == 0.0
    rows = tensor_stats(t, Plan([5], torch.device("cpu"), small=small), 1.0,
                        limits(torch.float16)).tolist()
    got = merge(rows, [5])
    assert got["underflow_rate"] == 0.25 and got["overflow_count"] == 0  # 1e-6 of four


def test_merge_of_all_zero_and_empty_layers():
    zeros = torch.zeros(4)
    rows = tensor_stats([zeros], Plan([4], torch.device("cpu")), 1.0, limits(torch.bfloat16))
    got = merge(rows.tolist(), [4])
    assert got == {"numel": 4, "norm": 0.0, "min_abs": 0.0, "max_abs": 0.0, "mean": 0.0,
                   "std": 0.0, "zero_frac": 1.0, "underflow_rate": 0.0, "overflow_count": 0}
    assert merge([], [])["numel"] == 0 and merge([], [])["std"] is None
