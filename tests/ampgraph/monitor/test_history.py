"""ampgraph/monitor/history.py: the logged history and its diagnoses (NumericsWarning)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from ampgraph.monitor import NumericsMonitor, NumericsWarning
from ampgraph.monitor.history import History, diagnose
from tests.ampgraph.monitor.helpers import fake_loop, grads, seq, step_record

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


# -- History and diagnose on hand-made records -----------------------------------------------


def test_history_fills_series_scales_and_summary_from_records():
    history = History()
    assert history.dtype == "fp16" and history.skipped_steps == 0  # before a start record
    history.add({"kind": "start", "version": 1, "dtype": "bf16", "every": 2, "track": ["grads"]})
    history.add(step_record(0, 1024.0, {"fc": grads(0.1, 0, 2.0)}))
    history.add({"kind": "scale", "history": {"step": [1], "loss_scale": [512.0],
                                              "overflow": [True]}})
    history.add(step_record(2, 512.0, {"fc": grads(0.05, 3, 1.5)}))
    assert history.dtype == "bf16" and history.meta["every"] == 2
    assert history.steps == [0, 2] and history.logged_scales == [1024.0, 512.0]
    assert history.scale_steps == [0, 1, 2] and history.scales == [1024.0, 512.0, 512.0]
    assert history.overflows == [False, True, False] and history.skipped_steps == 1
    assert history.series["grads"]["fc"]["step"] == [0, 2]
    assert history.series["grads"]["fc"]["underflow_rate"] == [0.1, 0.05]
    row = history.summary()["fc"]
    assert row["underflow_rate"] == 0.05 and row["underflow_rate_max"] == 0.1
    assert row["overflow_count"] == 3 and row["grad_norm"] == 1.5 and row["logged_steps"] == 2


def test_other_kinds_summarise_as_their_own_dict():
    history = History()
    record = step_record(0, 1.0, {})
    record["layers"] = {"fc": {"weights": grads(0.2, 1), "grads": grads(0.0)}}
    history.add(record)
    row = history.summary()["fc"]
    assert row["weights"]["underflow_rate"] == 0.2 and row["weights"]["overflow_total"] == 1
    assert row["weights"]["underflow_rate_max"] == 0.2 and row["underflow_rate"] == 0.0


def test_diagnose_nothing_on_an_empty_or_healthy_history():
    assert diagnose(History()) == []
    history = History()
    for i in range(6):
        history.add(step_record(i, 2.0**16, {"fc": grads(0.001)}))
    assert diagnose(history) == []


def test_a_rising_underflow_rate_is_diagnosed_with_its_layer():
    history = History()
    for i, rate in enumerate([0.01, 0.05, 0.2, 0.4]):
        history.add(step_record(i, 1024.0, {"fc": grads(rate, numel=10**6), "ok": grads(0.0)}))
    (found,) = diagnose(history)
    assert found.key == "underflow_rising" and found.layers == ("fc",)
    assert "fc (1.0% -> 40.0%)" in found.message and "module_overrides={'fc': 'fp32'}" in \
        found.message


def test_a_rise_within_sampling_noise_is_not_diagnosed():
    history = History()
    for i, rate in enumerate([0.01, 0.02, 0.03]):  # 100 values: three sigmas are ~5 points
        history.add(step_record(i, 1024.0, {"bias": grads(rate, numel=100)}))
    assert diagnose(history) == []


def test_an_overflowing_layer_in_three_logged_steps_is_named():
    history = History()
    for i in range(3):
        history.add(step_record(i, 2.0**16, {"a": grads(0.0, 2), "b": grads(0.0, 1 if i else 0)},
                                overflow=True))
    (found,) = diagnose(history)
    assert found.key == "repeated_overflow" and found.layers == ("a",)
    assert "a (3 logged steps, 6 values)" in found.message


def test_a_collapsed_scale_in_bf16_suggests_a_generic_floor():
    history = History()
    history.add({"kind": "start", "dtype": "bf16"})
    for i, scale in enumerate([1024.0, 64.0, 32.0, 16.0]):
        history.add(step_record(i, scale, {"fc": grads(0.0)}))
    (found,) = diagnose(history)
    assert found.key == "loss_scale_low" and found.layers == ()
    assert "collapsed to 16 (peak 1024)" in found.message
    assert "DynamicLossScaleManager(min_loss_scale=1024)" in found.message
