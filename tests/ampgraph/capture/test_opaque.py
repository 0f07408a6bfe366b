"""ampgraph/capture/opaque.py: a call kept out of a graph is one node while export traces,
and the user's own code, under autograd, once the graph is bound."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ampgraph.capture.opaque import (
    OpaqueCall,
    bind_opaque_calls,
    emit,
    opaque_nodes,
    registered,
    release,
)
from ampgraph.capture.watch import watching


class Doubler(OpaqueCall):
    kind = "test call"

    def run(self, args, kwargs):
        x, n = args
        return {"y": x * 2 * n, "n": n}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        out = emit(Doubler("double", (self.fc(x), 3), {}))
        return out["y"] + out["n"]


def exported() -> tuple[nn.Module, torch.fx.GraphModule, list[int]]:
    model = Model()
    with watching(model, lambda m, call, a, k: call(m, *a, **k)) as watch:
        ep = torch.export.export(model, (torch.randn(2, 4),), strict=False)
    return model, ep.module(), watch.emitted


def test_a_call_is_one_node_and_binding_makes_it_the_users_code():
    model, gm, keys = exported()
    (node,) = opaque_nodes(gm)
    assert node.args[0] == keys[0] and set(keys) <= registered()
    (call,) = bind_opaque_calls(gm)
    assert node.target is call and not set(keys) & registered(), "bound: released"
    x = torch.randn(2, 4, requires_grad=True)
    out = gm(x)
    torch.testing.assert_close(out, model.fc(x) * 6 + 3)
    out.sum().backward()
    assert x.grad is not None, "the call ran under autograd"


def test_a_different_result_structure_at_run_time_is_an_error():
    _, gm, _ = exported()
    (call,) = bind_opaque_calls(gm)
    call.run = lambda args, kwargs: (args[0],)
    with pytest.raises(RuntimeError, match="returned tuple of"):
        gm(torch.randn(2, 4))


def test_release_forgets_the_calls_of_a_failed_capture():
    _, _, keys = exported()
    release(keys)
    assert not set(keys) & registered()
