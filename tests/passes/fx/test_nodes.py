"""passes/fx/nodes.py: op keys, meta values' tensors and what else the passes read off a
node."""

from __future__ import annotations

import operator

import torch
from torch import fx

from passes.fx.nodes import op_key, tensors


def test_op_key_cache_is_keyed_by_the_target_itself():
    g = fx.Graph()
    x = g.placeholder("x")
    keys = []
    for name in ("first", "second"):
        def fn(v):
            return v
        fn.__name__ = name
        keys.append(op_key(g.call_function(fn, (x,))))
        del fn  # a new function may reuse the id
    assert keys == ["first", "second"]
    assert op_key(x) == "x"


def test_tensors_flattens_nested_values_in_order():
    a, b, c = torch.zeros(1), torch.ones(1), torch.zeros(2)
    assert [id(t) for t in tensors((a, [b, (None, c)], 3))] == [id(a), id(b), id(c)]
    assert tensors(a)[0] is a and tensors(None) == [] and tensors([1, 2.0]) == []


def test_getitem_key_is_cached_and_stays_getitem():
    g = fx.Graph()
    x = g.placeholder("x")
    item = g.call_function(operator.getitem, (x, 0))
    assert op_key(item) == op_key(item) == "getitem"
