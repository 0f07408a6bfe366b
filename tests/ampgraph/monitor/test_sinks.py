"""ampgraph/monitor/sinks.py: JSON lines and TensorBoard."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch

import ampgraph.monitor.sinks as monitor_io
from ampgraph.monitor import NumericsMonitor, NumericsWarning
from ampgraph.monitor.sinks import (
    LOG_NAME,
    ROOT_LAYER,
    LogWriter,
    clean,
    entry,
    fetch,
    layer_name,
    optimizer_info,
    parse_dtype,
)
from tests.ampgraph.monitor.helpers import fake_loop, records, seq

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]


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


# -- the writer and the helpers -------------------------------------------------------------


def test_log_writer_starts_a_fresh_file_and_appends_clean_records(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOG_NAME).write_text("an old run\n")
    writer = LogWriter(tmp_path / "run", tensorboard=False, start={"kind": "start"})
    writer.write({"kind": "scale", "history": {"loss_scale": [math.inf, 1 / 3]}})
    writer.close()
    lines = (tmp_path / "run" / LOG_NAME).read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"kind": "start"}, {"kind": "scale", "history": {"loss_scale": [None, 0.333333]}}]
    quiet = LogWriter(None, tensorboard=True, start={"kind": "start"})
    assert quiet.tensorboard is False
    quiet.write({"kind": "step"})  # nowhere to write: nothing happens


def test_parse_dtype_accepts_names_and_torch_dtypes_only_16_bit():
    assert parse_dtype(None) is None
    assert parse_dtype("FP16") is parse_dtype("torch.float16") is torch.float16
    assert parse_dtype("bfloat16") is parse_dtype(torch.bfloat16) is torch.bfloat16
    for bad in ("fp8", torch.float32, 16):
        with pytest.raises(ValueError, match="dtype must be None, 'fp16' or 'bf16'"):
            parse_dtype(bad)


def test_layer_name_is_the_owning_module():
    assert layer_name("encoder.layer.0.attention.query.weight") == "encoder.layer.0.attention.query"
    assert layer_name("scale") == ROOT_LAYER == "<root>"


def test_entry_keeps_tensors_on_the_device_and_floats_on_the_host():
    assert entry(None, None)[1] == 1.0 and math.isnan(entry(None, None)[0])
    assert entry(128, True) == (1.0, 128.0)
    scale = torch.tensor([256.0])
    both = entry(scale, False)
    assert isinstance(both, torch.Tensor) and both.tolist() == [0.0, 256.0]
    scale.fill_(1.0)
    assert both.tolist() == [0.0, 256.0]  # a copy: later scale updates do not reach it
    assert entry(2.0, torch.tensor(True)).tolist() == [1.0, 2.0]


def test_fetch_returns_each_tensors_values_in_order():
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor(3, dtype=torch.int64),
               torch.zeros(2, 2, dtype=torch.bfloat16)]
    assert fetch(tensors) == [[1.0, 2.0], [3.0], [0.0] * 4]
    assert fetch([]) == []


def test_optimizer_info_lists_eps_and_state_dtypes():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([{"params": [p], "eps": 1e-8}, {"params": [], "eps": 1e-6}])
    assert optimizer_info(opt) == {"type": "Adam", "eps": [1e-8, 1e-6], "state_dtypes": []}
    p.grad = torch.ones(3)
    opt.step()
    assert optimizer_info(opt)["state_dtypes"] == ["float32"]  # step is 0-dim: not listed
    assert optimizer_info(torch.optim.SGD([p], lr=0.1))["eps"] == []


def test_clean_nulls_non_finite_floats_and_rounds_to_six_digits():
    record = {"a": [math.nan, -math.inf, 1.23456789, 2], "b": {"c": 1e-12 / 3}, "d": "x"}
    assert clean(record) == {"a": [None, None, 1.23457, 2], "b": {"c": 3.33333e-13}, "d": "x"}
