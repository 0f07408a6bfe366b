"""passes/fx/nodes.py: op keys, meta values' tensors and what else the passes read off a
node."""

from __future__ import annotations

import operator

import torch
from torch import fx, nn

from passes.fx.nodes import (
    FLOATS,
    SHORT_NAMES,
    explicit_cast_dtype,
    fetch_attr,
    has_fp64,
    is_cast_key,
    is_float,
    is_view,
    module_info,
    node_inputs,
    op_key,
    sdpa_mask,
    set_sdpa_mask,
    target_info,
    tensors,
)


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


def test_target_info_and_cast_keys():
    assert target_info(torch.ops.aten._to_copy.default)[1:] == ("aten._to_copy", True)
    assert target_info(torch.ops.aten.relu.default)[1:] == ("aten.relu", False)
    assert target_info(operator.getitem)[1:] == ("getitem", False)
    assert all(is_cast_key(k) for k in ("aten.to.dtype", "aten._to_copy",
                                        "aten.type_as"))
    assert not is_cast_key("aten.add.Tensor")


def test_float_and_fp64_values():
    f16, f64, i64 = torch.zeros(1).half(), torch.zeros(1).double(), torch.zeros(1).long()
    assert is_float(f16) and is_float((i64, [f16])) and not is_float((i64, f64, None))
    assert has_fp64([i64, (f64,)]) and not has_fp64((f16, i64)) and not has_fp64(None)
    assert set(FLOATS) == set(SHORT_NAMES) == {torch.float32, torch.float16, torch.bfloat16}


class Inner(nn.Module):
    def forward(self, x):
        return x.to(torch.float16).to(dtype=torch.float32) + x.view(-1).sum()


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner, self.fc = Inner(), nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(self.fc(x))


def test_what_a_captured_node_tells():
    gm = torch.export.export(Outer(), (torch.randn(2, 4),), strict=False).module()
    nodes = {n.name: n for n in gm.graph.nodes}
    to16, to32 = [n for n in gm.graph.nodes if op_key(n).startswith("aten.to")
                  or op_key(n).startswith("aten._to_copy")]
    assert explicit_cast_dtype(to16) == torch.float16
    assert explicit_cast_dtype(to32) == torch.float32
    assert explicit_cast_dtype(nodes["linear"]) is None
    path, classes = module_info(to16)
    assert path == "inner" and classes[-1].endswith("Inner")
    assert module_info(nodes["x"]) == ("", ())
    (view,) = [n for n in gm.graph.nodes if op_key(n) == "aten.view"]
    assert is_view(view) and not is_view(nodes["linear"]) and not is_view(nodes["x"])
    weight = next(n for n in gm.graph.nodes if n.op == "get_attr" and "weight" in n.target)
    assert fetch_attr(gm, weight.target) is gm.fc.weight
    assert node_inputs(nodes["linear"]) == list(nodes["linear"].all_input_nodes)


def test_sdpa_mask_reads_and_set_sdpa_mask_replaces_the_mask_where_it_was_passed():
    graph = fx.Graph()
    q, k, v, m, other = (graph.placeholder(n) for n in "qkvmo")
    sdpa = torch.ops.aten.scaled_dot_product_attention.default
    positional = graph.call_function(sdpa, (q, k, v, m))
    keyword = graph.call_function(sdpa, (q, k, v), {"attn_mask": m, "is_causal": False})
    bare = graph.call_function(sdpa, (q, k, v))
    assert sdpa_mask(positional) is m and sdpa_mask(keyword) is m and sdpa_mask(bare) is None
    set_sdpa_mask(positional, other)
    set_sdpa_mask(keyword, None)
    assert positional.args[3] is other and keyword.kwargs == {"attn_mask": None,
                                                               "is_causal": False}
