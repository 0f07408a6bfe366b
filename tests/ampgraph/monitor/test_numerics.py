"""NumericsMonitor: underflow/overflow statistics, JSONL, diagnoses, plot, report, overhead."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampgraph
import ampgraph.monitor.sinks as monitor_io
from ampgraph.cli import report_main
from ampgraph.monitor import NumericsMonitor, NumericsWarning
from ampgraph.monitor.stats import Plan, limits, merge, tensor_stats
from ampgraph.train.loss_scale import FixedLossScaleManager

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]




class TwoBranch(nn.Module):
    """``big`` gets ordinary gradients; ``small``'s are 1e-6 times smaller (fp16 subnormals)."""

    def __init__(self) -> None:
        super().__init__()
        self.big = nn.Linear(16, 4)
        self.small = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.big(x) + self.small(x) * 1e-6


def data(i: int, gain: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(16, 16, generator=g) * gain, torch.randn(16, 4, generator=g)


def run(dtype: str, steps: int = 3, overflow_at: int | None = None, **mon_kwargs):
    torch.manual_seed(0)
    model = TwoBranch()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    mon = NumericsMonitor(**{"every": 1, **mon_kwargs})
    manager = FixedLossScaleManager(128.0) if dtype == "fp16" else None
    step = ampgraph.build_train_step(model, F.mse_loss, opt, "O2", dtype,
                                     loss_scale_manager=manager, monitor=mon)
    outs = [step(*data(i, 1e4 if i == overflow_at else 1.0)) for i in range(steps)]
    return mon, outs


def records(log_dir) -> list[dict]:
    with open(log_dir / "numerics.jsonl") as f:
        return [json.loads(line) for line in f]


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


def fake_loop(mon: NumericsMonitor, model: nn.Module, scales, overflows, grad=1e-2,
              first=1e-7, bad_layer: str | None = None) -> None:
    """A hand-written loop without a real backward: set the (unscaled) gradients, then step.

    Layer "0" gets gradients of magnitude ``first``, the others ``grad``.
    """
    for i, (scale, overflow) in enumerate(zip(scales, overflows)):
        g = torch.Generator().manual_seed(i)
        for name, p in model.named_parameters():
            magnitude = first if name.startswith("0.") else grad
            p.grad = torch.randn(p.shape, generator=g) * magnitude
            if bad_layer and name.startswith(bad_layer):
                p.grad.view(-1)[0] = math.inf
        mon.step(loss_scale=scale, overflow=overflow)


def seq() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


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


# -- outputs: plot, report, TensorBoard -----------------------------------------------------


def test_plot_and_monitor_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    mon, _ = run("fp16", steps=3, overflow_at=1, log_dir=tmp_path / "log")
    png = mon.plot(tmp_path / "live.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report_main([str(tmp_path / "log"), "--plot", str(tmp_path / "cli.png")]) == 0
    out = capsys.readouterr().out
    assert "small" in out and "skipped steps (overflow): 1" in out
    assert (tmp_path / "cli.png").stat().st_size > 1000


def test_monitor_report_errors_are_one_line_exit_2(tmp_path, capsys):
    assert report_main([str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    (tmp_path / "empty" / "numerics.jsonl").write_text("")
    assert report_main([str(tmp_path / "empty")]) == 2
    assert report_main([str(tmp_path), "--top", "many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(e.startswith("ampgraph monitor-report: error:") for e in err)
    assert report_main(["--help"]) == 0


def test_tensorboard_scalars_and_missing_tensorboard(tmp_path, monkeypatch):
    class Writer:
        def __init__(self) -> None:
            self.scalars: list[tuple[str, float, int]] = []

        def add_scalar(self, tag: str, value: float, step: int) -> None:
            self.scalars.append((tag, value, step))

        def close(self) -> None:
            pass

    writer = Writer()
    monkeypatch.setattr(monitor_io, "summary_writer", lambda log_dir: writer)
    model = seq()
    mon = NumericsMonitor(every=2, log_dir=tmp_path, tensorboard=True).attach(model)
    fake_loop(mon, model, [2.0**10] * 3, [False] * 3)
    tags = {t for t, _, _ in writer.scalars}
    assert {"numerics/loss_scale", "numerics/skipped_steps", "numerics/grads/underflow_rate/0",
            "numerics/grads/norm/2"} <= tags
    assert [s for t, _, s in writer.scalars if t == "numerics/loss_scale"] == [0, 1, 2]
    monkeypatch.undo()
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails
    mon = NumericsMonitor(every=1, log_dir=tmp_path, tensorboard=True).attach(model)
    with pytest.warns(NumericsWarning, match="pip install tensorboard") as caught:
        fake_loop(mon, model, [1.0] * 3, [False] * 3)
    assert len(caught) == 1  # warned once, then JSON lines only
    assert len(records(tmp_path)) == 4


def test_import_stays_lean():
    code = ("import sys, ampgraph.monitor; print([m for m in ('matplotlib', 'tensorboard') "
            "if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_cli_monitor_report_is_wired(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ampgraph", "monitor-report", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "numerics" in proc.stderr.lower()
