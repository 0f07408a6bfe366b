"""ampgraph/capture/watch.py: while the body runs, the model's modules record the attributes
forward reads and writes (this thread only), and their calls go through the route."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from ampgraph.capture.watch import DELETED, Watch, active, original_class, paused, watching


class Reader(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.t = 2.0
        self.buf = None
        self.register_buffer("stat", torch.zeros(4))

    def forward(self, x):
        if hasattr(self, "extra"):
            x = x + 1
        self.seen = True  # a write
        self.stat = self.stat + 1  # a buffer assigned: traced by export, not a side effect
        return self.fc(x) / self.t


def test_reads_misses_and_writes_are_recorded_by_instance_dict():
    model = Reader()
    with watching(model) as watch:
        model(torch.randn(2, 4))
    read = {name: value for d, name, value in watch.reads.values() if d is model.__dict__}
    assert read["t"] == 2.0
    assert (id(model.__dict__), "extra") in watch.missing
    assert ("fc" not in read) and ("_parameters" not in read), "structure is not a read"
    writes = {name: value for _, name, value, _ in watch.writes.values()}
    assert writes == {"seen": True}, "a buffer assigned is export's to trace"


def test_classes_are_restored_even_when_the_body_raises():
    model = Reader()
    classes = [type(m) for m in model.modules()]
    with pytest.raises(RuntimeError, match="boom"), watching(model):
        assert type(model) is not Reader and original_class(model) is Reader
        assert isinstance(model, Reader) and type(model).__qualname__ == "Reader"
        raise RuntimeError("boom")
    assert [type(m) for m in model.modules()] == classes and active() is None


def test_calls_go_through_the_route_unless_paused():
    model = Reader()
    seen = []

    def route(module, call, args, kwargs):
        seen.append(type(module).__name__)
        return call(module, *args, **kwargs)

    with watching(model, route) as watch:
        model(torch.randn(2, 4))
        with paused(watch):
            model.fc(torch.randn(2, 4))
    assert seen == ["Reader", "Linear"], "the paused call is a plain one"
    assert isinstance(watch, Watch) and watch.stack == []


def test_another_thread_records_nothing_and_deletes_are_writes():
    model = Reader()
    done = []
    with watching(model) as watch:
        t = threading.Thread(target=lambda: done.append(model(torch.randn(2, 4))))
        t.start()
        t.join()
        assert watch.reads == {} and watch.writes == {}, "only the watching thread records"
        del model.seen
    assert done and list(watch.writes.values())[0][2] is DELETED
