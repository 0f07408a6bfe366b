"""passes/fx/insert_casts.py: one shared cast per producer and dtype, re-linking."""

from __future__ import annotations

import torch
from torch import fx

from passes.fx.dtypes import is_amp_cast
from passes.fx.insert_casts import _rewire
from tests.passes.fx.helpers import TwoConsumers, check_pass


def test_one_cast_per_producer_shared_by_consumers():
    model = TwoConsumers()
    x = torch.randn(3, 4)
    gm, _ = check_pass(model, (x,), "O2", torch.bfloat16)
    casts_of_x = [n for n in gm.graph.nodes if is_amp_cast(n) and n.args[0].op == "placeholder"]
    assert len(casts_of_x) == 1, "a graph input with several low consumers is cast once"
    b_weight_casts = [n for n in gm.graph.nodes if is_amp_cast(n)
                      and n.args[0].op == "get_attr" and n.args[0].target == "b.weight"]
    assert len(b_weight_casts) == 1, "a weight used twice is cast once per forward"
    # h feeds bf16 (b, mul) and fp32 (layer_norm) consumers: one cast to fp32, shared
    linear_a = next(n for n in gm.graph.nodes if n.name == "linear")
    assert [u.kwargs.get("dtype") for u in linear_a.users if is_amp_cast(u)] == [torch.float32]


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
