"""ampgraph/demo.py: the demo's pieces and a tiny run of it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampgraph import demo

pytestmark = pytest.mark.usefixtures("one_thread")


def test_load_reference_model_finds_models_by_name(monkeypatch, tmp_path):
    mod = demo.load_reference_model("tabular_mlp")
    assert callable(mod.make_model) and callable(mod.example_inputs)
    monkeypatch.chdir(tmp_path)  # the package's own checkout is searched too
    assert callable(demo.load_reference_model("lenet5").make_model)
    with pytest.raises(FileNotFoundError, match="models/no_such.py not found"):
        demo.load_reference_model("no_such")


def test_digits_are_a_fixed_80_20_split_scaled_to_0_1():
    pytest.importorskip("sklearn")
    xtr, ytr, xte, yte = demo.digits()
    assert (xtr.shape, xte.shape) == ((1437, 64), (360, 64))
    assert ytr.dtype == torch.long and set(yte.tolist()) <= set(range(10))
    assert 0.0 <= float(xtr.min()) and float(xtr.max()) <= 1.0
    assert torch.equal(demo.digits()[0], xtr)  # the same split every time


def test_train_reports_accuracy_step_time_and_loss():
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = (x[:, 0] > 0).long()
    net = nn.Linear(4, 2)
    got = demo.train(net, net.parameters(), (x, y, x, y), epochs=3, batch=16)
    assert set(got) == {"accuracy", "median_ms", "loss"}
    assert 0.0 <= got["accuracy"] <= 1.0 and got["median_ms"] > 0 and not net.training


def test_a_tiny_demo_run_prints_both_results_and_the_plan(capsys):
    pytest.importorskip("sklearn")
    assert demo.main(["--epochs", "1", "--hidden", "16", "--batch", "512", "--dtype",
                      "bf16"]) == 0
    out = capsys.readouterr().out
    assert "compiled at O2, dtype bf16" in out
    assert "\nFP32 " in out and "\nO2 " in out and "speed-up" in out
    assert "parameters stay fp32" in out and "aten.linear" in out
