"""ampgraph/monitor/history.py: the logged history and its diagnoses (NumericsWarning)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from ampgraph.monitor import NumericsMonitor, NumericsWarning
from tests.ampgraph.monitor.helpers import fake_loop, seq

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]


def test_collapsing_scale_warns_with_layers_and_remedies():
    model = seq()
    mon = NumericsMonitor(every=2).attach(model)
    scales = [2.0 ** max(16 - i, 0) for i in range(30)]
    with pytest.warns(NumericsWarning) as caught:
        fake_loop(mon, model, scales, [True] * 30)
    messages = [str(w.message) for w in caught]
    low = [m for m in messages if "loss scale collapsed" in m]
    rising = [m for m in messages if "underflow rate is rising" in m]
    assert len(low) == 1 and len(rising) == 1  # each diagnosis once per monitor
    assert "layer(s): 0 (" in rising[0]  # the layer with 1e-7 gradients, named
    for remedy in ("bf16", "module_overrides={'0': 'fp32'}", "a higher loss scale is not "
                   "available (the lowest scale that overflowed was 2**"):
        assert remedy in rising[0]  # every step overflowed: a floor cannot help the trend
    # but a floor stops the collapse: the largest gradients (<= ~4e-2) fit fp16 up to 2**19
    assert int(re.search(r"minimum loss scale of 2\*\*(\d+) ", low[0]).group(1)) >= 19
    assert "bf16" in low[0]
    assert {d.key for d in mon.diagnoses} == {"loss_scale_low", "underflow_rising"}


def test_underflow_trend_without_overflows_suggests_a_minimum_scale():
    model = seq()
    mon = NumericsMonitor(every=2).attach(model)
    with pytest.warns(NumericsWarning) as caught:
        fake_loop(mon, model, [2.0 ** max(16 - i, 6) for i in range(16)], [False] * 16)
    assert {d.key for d in mon.diagnoses} == {"underflow_rising", "loss_scale_low"}
    low = next(str(w.message) for w in caught if "collapsed" in str(w.message))
    assert "no overflow was recorded" in low
    rising = next(str(w.message) for w in caught if "rising" in str(w.message))
    scale, floor = re.search(r"At loss scale (\d+) .* minimum loss scale of 2\*\*(\d+) ",
                             rising).groups()
    assert 2 ** int(floor) > int(scale) and int(floor) >= 19  # gradients <= ~4e-2 fit


def test_healthy_run_does_not_warn():
    model = seq()
    mon = NumericsMonitor(every=2).attach(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NumericsWarning)
        fake_loop(mon, model, [2.0**16] * 30, [False] * 30, first=1e-2)
        # a fixed low scale chosen on purpose is not a collapse either
        fake_loop(NumericsMonitor(every=2).attach(model), model, [256.0] * 30, [False] * 30,
                  first=1e-3)
    assert mon.diagnoses == [] and mon.skipped_steps == 0


def test_repeated_overflow_in_one_layer_is_named():
    model = seq()
    mon = NumericsMonitor(every=1).attach(model)
    with pytest.warns(NumericsWarning, match=r"repeated overflows in 1 layer\(s\): 2 ") as w:
        fake_loop(mon, model, [2.0**16] * 4, [True] * 4, bad_layer="2.")
    assert "module_overrides={'2': 'fp32'}" in str(w[0].message)
    assert mon.summary()["2"]["overflow_count"] == 4 * 2  # one inf in weight and in bias
    assert mon.summary()["0"]["overflow_count"] == 0


def test_fp16_adam_state_below_min_normal_suggests_a_larger_eps():
    torch.manual_seed(0)
    model = nn.Linear(8, 4).half()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8)
    mon = NumericsMonitor(every=1, track=("grads", "optimizer")).attach(model, opt)
    with pytest.warns(NumericsWarning, match="raise Adam eps"):
        for _ in range(2):
            for p in model.parameters():
                p.grad = torch.full_like(p, 1e-4)  # v = 1e-8 * (1 - beta2): flushes in fp16
            mon.step()
            opt.step()
    assert "optimizer.exp_avg_sq" in mon.summary()["<root>"]
