"""passes/fx/routing/embeddings.py: lookups on a float parameter table call the runtime's
embedding, tied tables with ``shared=True``; same values and gradients."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from passes.fx.routing.embeddings import route_embeddings
from tests.passes.fx.routing.helpers import CALLS, cached_cast, rewritten

aten = torch.ops.aten


def amp_embedding(w, ids, padding_idx=-1, shared=False):
    CALLS.append(("embedding", shared))
    return aten.embedding(w, ids, padding_idx)


class Lookup(nn.Module):
    """An embedding lookup, its table tied to the output projection when ``tied``."""

    def __init__(self, tied: bool = False, **options):
        super().__init__()
        self.emb = nn.Embedding(50, 8, **options)
        self.out = nn.Linear(8, 50, bias=False)
        if tied:
            self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.emb(ids))


def routed(model, ids):
    return rewritten(model, ids, torch.bfloat16, weight_cast=cached_cast,
                     embedding=amp_embedding)[0]


def calls(gm):
    return [n for n in gm.graph.nodes if n.target is amp_embedding]


@pytest.mark.parametrize("tied", [False, True])
def test_lookups_call_the_runtime_with_the_same_values_and_gradients(tied):
    torch.manual_seed(0)
    model = Lookup(tied, padding_idx=0)
    ids = torch.randint(0, 50, (2, 5))
    ids[0, 0] = 0
    gm = routed(model, ids)
    plain = rewritten(copy.deepcopy(model), ids, torch.bfloat16)[0]
    (call,) = calls(gm)
    assert aten.embedding.default not in {n.target for n in gm.graph.nodes}
    assert call.args[0].op == "get_attr" and call.args[2] == 0, "the fp32 table, padding_idx"
    assert call.kwargs == ({"shared": True} if tied else {})
    assert call.meta["amp_orig_op"] == "aten.embedding"
    gm.graph.lint()
    CALLS.clear()
    out, want = gm(ids), plain(ids)
    assert ("embedding", tied) in CALLS
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    out.float().sum().backward()
    want.float().sum().backward()
    for p, q in zip(gm.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0)


@pytest.mark.parametrize("options", [{"scale_grad_by_freq": True}, {"sparse": True}])
def test_lookups_with_frequency_scaled_or_sparse_gradients_are_left_alone(options):
    model, ids = Lookup(**options), torch.randint(0, 50, (2, 5))
    assert calls(routed(model, ids)) == []


def graph_with_lookup(table):
    """``embedding(table, ids)``, the table a parameter or buffer of the module."""
    g = torch.fx.Graph()
    ids = g.placeholder("ids")
    w = g.get_attr("table")
    g.output(g.call_function(aten.embedding.default, (w, ids)))
    root = nn.Module()
    if isinstance(table, nn.Parameter):
        root.table = table
    else:
        root.register_buffer("table", table)
    return torch.fx.GraphModule(root, g)


def test_only_float_tables_are_routed():
    floats = graph_with_lookup(nn.Parameter(torch.randn(10, 4)))
    assert route_embeddings(floats, amp_embedding).modified
    assert len(calls(floats)) == 1 and calls(floats)[0].kwargs == {}
    ints = graph_with_lookup(torch.arange(40).view(10, 4))  # an integer table: aten's
    assert not route_embeddings(ints, amp_embedding).modified
    assert calls(ints) == []
