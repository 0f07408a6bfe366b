"""The shortcuts the FX pipeline takes for speed leave what the plain ways leave.

The collector is paused around the passes and restored; ``prepare`` can leave the lint and
the recompile to the pipeline's end; cast insertion re-links a node's inputs without
``Node.__setattr__``; ``tensors`` flattens without a call per tensor.
"""

from __future__ import annotations

import gc
import operator

import pytest
import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from passes.fx.graph import op_key, prepare, tensors
from passes.fx.insert_casts import _rewire
from passes.fx.pipeline import gc_paused, run_amp_passes
from passes.policy import make_policy


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_restores_the_collector_state(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError("a failing pass")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_run_amp_passes_leaves_the_collector_on():
    gm = torch.export.export(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),),
                             strict=False).module()
    assert gc.isenabled()
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    assert gc.isenabled()


def in_place_graph() -> fx.GraphModule:
    def f(x, w):
        h = x @ w
        h.relu_()  # an in-place op on an activation: prepare makes it functional
        return h + x @ w

    return make_fx(f, tracing_mode="fake")(torch.randn(2, 4), torch.randn(4, 4))


def test_prepare_without_recompile_rewrites_the_graph_alike():
    eager, deferred = in_place_graph(), in_place_graph()
    assert prepare(eager).modified and prepare(deferred, recompile=False).modified
    assert str(deferred.graph) == str(eager.graph)
    in_place = "aten.relu_.default"
    assert in_place in deferred.code and in_place not in eager.code  # forward not regenerated
    deferred.recompile()
    assert deferred.code == eager.code


def test_rewire_leaves_what_assigning_args_and_kwargs_leaves():
    def build():
        g = fx.Graph()
        x, y = g.placeholder("x"), g.placeholder("y")
        other = g.call_function(torch.add, (x, y))  # another user of x and y, listed first
        node = g.call_function(torch.add, (x, [y, x]), {"alpha": y, "out": None})
        new = g.call_function(torch.neg, (y,))
        g.output((node, other))
        return g, x, y, node, new

    g1, x1, y1, node1, new1 = build()
    _rewire(node1, {(0, x1): new1, (1, y1): new1, ("alpha", y1): new1})
    g2, x2, y2, node2, new2 = build()
    node2.args = (new2, [new2, x2])
    node2.kwargs = {"alpha": new2, "out": None}
    assert str(g1) == str(g2)
    for a, b in zip(g1.nodes, g2.nodes):
        assert [u.name for u in a.users] == [u.name for u in b.users]
        assert [i.name for i in a.all_input_nodes] == [i.name for i in b.all_input_nodes]


def test_tensors_flattens_nested_values_in_order():
    a, b, c = torch.zeros(1), torch.ones(1), torch.zeros(2)
    assert [id(t) for t in tensors((a, [b, (None, c)], 3))] == [id(a), id(b), id(c)]
    assert tensors(a)[0] is a and tensors(None) == [] and tensors([1, 2.0]) == []


def test_getitem_key_is_cached_and_stays_getitem():
    g = fx.Graph()
    x = g.placeholder("x")
    item = g.call_function(operator.getitem, (x, 0))
    assert op_key(item) == op_key(item) == "getitem"
