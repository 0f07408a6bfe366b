"""passes/fx/weight_groups.py: parameter casts as one call per group, in order of first use
and bounded in size; the same values."""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx, nn

from passes.fx.dtypes import is_amp_cast
from passes.fx.pipeline import run_amp_passes
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps
from passes.fx.weight_groups import group_weight_casts

GROUPS: list[tuple] = []


def make_group(specs):
    """What a runtime hands in: a factory taking the members' (dtype, memory_format)."""
    GROUPS.append(specs)

    def group(*params):
        return tuple(p.to(dtype) if layout is None else p.to(dtype, memory_format=layout)
                     for p, (dtype, layout) in zip(params, specs))

    return group


class Layers(nn.Module):
    """Linears of 64+8, 256+16 (over the bound alone) and 64+8 elements, then the first
    again."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(16, 16), nn.Linear(8, 8)
        self.up = nn.Linear(8, 16)

    def forward(self, x):
        h = self.up(self.a(x))
        h = self.b(h)[..., :8]
        return self.a(self.c(h))


def rewritten(model, x, **ops):
    gm = torch.export.export(model, (x,), strict=False).module()
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16, runtime=RuntimeOps(**ops))
    return gm


def test_groups_follow_first_use_stay_bounded_and_give_the_same_values():
    torch.manual_seed(0)
    model, x = Layers(), torch.randn(3, 8)
    GROUPS.clear()
    gm = rewritten(model, x, weight_group=make_group, group_numel=200)
    plain = rewritten(copy.deepcopy(model), x)
    nodes = list(gm.graph.nodes)
    calls = [n for n in nodes if n.op == "call_function" and n.meta.get("amp_cast")
             and n.target not in (torch.ops.aten._to_copy.default, operator.getitem)]
    assert len(calls) == len(GROUPS) > 1
    assert not any(is_amp_cast(n) and n.target is torch.ops.aten._to_copy.default
                   and n.args[0].op == "get_attr" for n in nodes), "every parameter cast grouped"
    order = {n: i for i, n in enumerate(nodes)}
    first_uses, sizes = [], []
    for call in calls:
        members = [a.target for a in call.args]
        assert all(a.op == "get_attr" for a in call.args)
        numel = sum(gm.get_parameter(t).numel() for t in members)
        assert numel <= 200 or len(members) == 1, (members, numel)
        sizes.append(numel)
        items = [u for u in call.users if u.target is operator.getitem]
        assert sorted(u.args[1] for u in items) == list(range(len(members)))
        first = min(order[w] for u in items for w in u.users)
        assert order[call] < first, "the call sits before its first use"
        first_uses.append(first)
        assert call.meta["amp_reason"] == f"{len(members)} parameter casts as one group"
    assert first_uses == sorted(first_uses), "groups in order of first use"
    assert max(sizes) == 256 and len(sizes) > 2, "b.weight over the bound: a group alone"
    assert [s[0][0] for s in GROUPS] == [torch.bfloat16] * len(GROUPS)
    gm.graph.lint()
    with torch.no_grad():
        torch.testing.assert_close(gm(x), plain(x), rtol=0, atol=0)


def test_a_graph_without_parameter_casts_is_left_alone():
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(g.call_function(torch.relu, (x,)))
    gm = fx.GraphModule(nn.Module(), g)
    GROUPS.clear()
    assert not group_weight_casts(gm, make_group).modified
    assert GROUPS == []
