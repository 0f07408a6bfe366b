"""NumericsMonitor: underflow/overflow statistics, JSONL, diagnoses, plot, report, overhead."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import ampgraph
import ampgraph.monitor.sinks as monitor_io
from ampgraph.monitor import NumericsMonitor, NumericsWarning
from tests.ampgraph.monitor.helpers import TwoBranch, data, fake_loop, records, run, seq

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]


# -- the acceptance tests -----------------------------------------------------------


def test_fp16_tiny_gradients_underflow_only_in_their_layer(tmp_path):
    mon, _ = run("fp16", log_dir=tmp_path)
    summary = mon.summary()
    assert summary["small"]["underflow_rate"] > 0.9  # ~1e-6 gradients x 128 < 2**-14
    assert summary["big"]["underflow_rate"] < 0.01
    assert summary["big"]["grad_norm"] > 1e3 * summary["small"]["grad_norm"]
    recs = records(tmp_path)
    assert recs[0] == {"kind": "start", "version": 1, "dtype": "fp16", "every": 1,
                       "track": ["grads"]}
    assert [r["step"] for r in recs[1:]] == [0, 1, 2]
    assert recs[1]["layers"]["small"]["grads"]["underflow_rate"] > 0.9


def test_bf16_same_model_shows_no_underflow():
    mon, _ = run("bf16")
    summary = mon.summary()
    assert summary["small"]["underflow_rate"] < 1e-6
    assert summary["big"]["underflow_rate"] < 1e-6
    assert mon.history.dtype == "bf16"
    assert [s for _, s, _ in mon.loss_scale_history] == [1.0, 1.0, 1.0]  # no scaling in bf16


def test_forced_overflow_is_counted_and_in_the_jsonl(tmp_path):
    mon, outs = run("fp16", steps=3, overflow_at=1, log_dir=tmp_path)
    assert [o.overflow for o in outs] == [False, True, False]
    rec = {r["step"]: r for r in records(tmp_path) if r["kind"] == "step"}
    assert rec[1]["overflow"] is True and rec[1]["skipped_steps"] == 1
    assert rec[1]["layers"]["big"]["grads"]["overflow_count"] > 0
    assert rec[0]["overflow"] is False and rec[0]["layers"]["big"]["grads"]["overflow_count"] == 0
    assert mon.summary()["big"]["overflow_count"] > 0
    assert mon.skipped_steps == 1
    assert [o for _, _, o in mon.loss_scale_history] == [False, True, False]


# -- attaching and the hand-written torch.amp loop ------------------------------------------


def test_hand_written_torch_amp_loop_reads_scale_and_overflow_from_the_scaler():
    model = seq()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    mon = NumericsMonitor(every=2, dtype="fp16").attach(model, opt)
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    used, backed_off = [], []
    for i in range(4):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x * (1e5 if i == 1 else 1.0)).float(), y)
        scaler.scale(loss).backward()
        if i == 2:
            with pytest.raises(RuntimeError, match="unscale_"):
                mon.step(loss_scale=scaler)
        scaler.unscale_(opt)
        used.append(scaler.get_scale())
        mon.step(loss_scale=scaler)
        scaler.step(opt)
        scaler.update()
        backed_off.append(scaler.get_scale() < used[-1])  # GradScaler's own overflow verdict
    history = mon.loss_scale_history
    assert [s for _, s, _ in history] == used
    assert [o for _, _, o in history] == backed_off == [False, True, False, False]
    assert mon.history.steps == [0, 2]


def test_train_step_with_accumulation_and_a_monitor_attached_to_the_plain_model():
    torch.manual_seed(0)
    model = TwoBranch()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = NumericsMonitor(every=2).attach(model, opt)  # the uncompiled model: dtype unknown
    step = ampgraph.build_train_step(model, F.mse_loss, opt, "O2", "bf16", monitor=mon,
                                     accumulation_steps=2)
    outs = [step(*data(i)) for i in range(6)]
    assert [o.stepped for o in outs] == [False, True] * 3
    assert mon.history.steps == [0, 2]  # optimizer steps 0, 1, 2; logged every 2nd
    assert mon.history.dtype == "bf16"  # taken from the compiled module at the first step
    assert [s for s, _, _ in mon.loss_scale_history] == [0, 1, 2]


def test_step_before_attach_and_bad_arguments():
    with pytest.raises(RuntimeError, match="attach"):
        NumericsMonitor().step(loss_scale=1.0)
    for kwargs, match in [({"every": 0}, "every"), ({"track": ("grads", "acts")}, "subset"),
                          ({"tensorboard": True}, "log_dir"), ({"dtype": "fp8"}, "dtype")]:
        with pytest.raises(ValueError, match=match):
            NumericsMonitor(**kwargs)
    with pytest.raises(ValueError, match="optimizer"):
        NumericsMonitor(track=("optimizer",)).attach(seq())
    net = ampgraph.compile(seq(), "O2", "bf16")
    with pytest.raises(ValueError, match="compiled for bf16"):
        NumericsMonitor(dtype="fp16").attach(net)


def test_logs_only_every_nth_step_with_one_fetch_each(monkeypatch):
    fetches = []
    real = monitor_io.fetch
    monkeypatch.setattr(monitor_io, "fetch", lambda ts: fetches.append(len(ts)) or real(ts))
    model = seq()
    mon = NumericsMonitor(every=5).attach(model)
    fake_loop(mon, model, [torch.tensor(1024.0)] * 11, [torch.tensor(0.0)] * 11)
    assert mon.history.steps == [0, 5, 10] and len(fetches) == 3
    assert len(mon._pending) == 0
    fake_loop(mon, model, [torch.tensor(1024.0)] * 2, [torch.tensor(0.0)] * 2)
    assert len(mon._pending) == 2 and len(fetches) == 3  # nothing fetched between log steps
    assert len(mon.loss_scale_history) == 13 and len(fetches) == 4


def test_weights_and_activations_of_an_uncompiled_model(tmp_path):
    model = seq()
    mon = NumericsMonitor(every=1, log_dir=tmp_path, track=("weights", "activations"))
    mon.attach(model)
    model(torch.randn(4, 8)).sum().backward()
    mon.step()
    layers = records(tmp_path)[1]["layers"]
    assert {k: sorted(v) for k, v in layers.items()} == {
        "0": ["activations", "weights"], "1": ["activations"], "2": ["activations", "weights"]}
    assert layers["1"]["activations"]["zero_frac"] > 0.2  # ReLU output
    assert layers["0"]["activations"]["numel"] == 4 * 16
    mon.close()
    model(torch.randn(4, 8))
    assert mon._act == {}  # hooks removed


def test_activations_of_a_compiled_model_are_its_outputs():
    net = ampgraph.compile(seq(), "O2", "bf16")
    with pytest.warns(NumericsWarning, match="only the model's outputs"):
        mon = NumericsMonitor(every=1, track=("activations",)).attach(net)
    net(torch.randn(4, 8)).sum().backward()
    mon.step()
    assert list(mon.summary()) == ["<output>"]


# -- importing -----------------------------------------------------------------------------


def test_import_stays_lean():
    code = ("import sys, ampgraph.monitor; print([m for m in ('matplotlib', 'tensorboard') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"

