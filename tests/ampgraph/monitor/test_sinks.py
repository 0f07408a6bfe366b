"""ampgraph/monitor/sinks.py: JSON lines and TensorBoard."""

from __future__ import annotations

import sys

import pytest

import ampgraph.monitor.sinks as monitor_io
from ampgraph.monitor import NumericsMonitor, NumericsWarning
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
