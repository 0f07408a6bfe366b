"""ampgraph/capture/calls.py: autocast off around a graph, dynamo's graph break, a graph's
error re-raised in eager's words."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampgraph.capture.calls import autocast_off, autocast_on, outside_dynamo, raise_eager_error


def test_autocast_is_off_inside_and_back_after():
    with torch.autocast("cpu", torch.bfloat16):
        assert autocast_on()
        with autocast_off():
            assert not autocast_on()
        assert autocast_on()
    assert not autocast_on()


def test_outside_dynamo_is_a_graph_break_that_runs_as_it_is():
    seen = []

    def run(x):
        seen.append(torch.compiler.is_compiling())
        return x * 2

    wrapped = outside_dynamo(run)
    assert outside_dynamo(run) is wrapped, "made once per function"
    compiled = torch.compile(lambda x: wrapped(x) + 1, backend="eager")
    torch.testing.assert_close(compiled(torch.ones(2)), torch.full((2,), 3.0))
    assert seen == [False], "run eagerly, not traced"


def test_the_eager_error_is_raised_when_eager_rejects_the_inputs_too():
    model = nn.Linear(4, 2)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        raise_eager_error(model, (torch.randn(3, 5),), {}, RuntimeError("graph's words"))
    ours = RuntimeError("graph's words")
    raise_eager_error(model, (torch.randn(3, 4),), {}, ours)
    assert "please report" in ours.__notes__[0]
