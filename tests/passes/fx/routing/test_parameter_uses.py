"""passes/fx/routing/parameter_uses.py: uses counted per parameter object, whatever
attribute paths read it."""

from __future__ import annotations

import torch
from torch import fx, nn

from passes.fx.routing.parameter_uses import parameter_uses


def test_uses_are_counted_per_parameter_across_attribute_paths():
    root = nn.Module()
    root.emb, root.out = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    root.out.weight = root.emb.weight  # tied: two paths, one parameter
    root.other = nn.Linear(4, 4)
    g = fx.Graph()
    ids = g.placeholder("ids")
    table = g.get_attr("emb.weight")
    h = g.call_function(torch.ops.aten.embedding.default, (table, ids))
    w = g.get_attr("out.weight")
    v = g.get_attr("other.weight")
    unused = g.get_attr("other.bias")
    a = g.call_function(torch.ops.aten.linear.default, (h, w))
    b = g.call_function(torch.ops.aten.linear.default, (a, v))
    g.output((g.call_function(torch.ops.aten.linear.default, (b, v)),))
    gm = fx.GraphModule(root, g)
    uses = parameter_uses(gm)
    assert uses[id(root.emb.weight)] == 2, "the embedding and the tied projection"
    assert uses[id(root.other.weight)] == 2, "one get_attr, two users"
    assert uses[id(root.other.bias)] == 0 and unused.users == {}
    assert len(uses) == 3
