"""passes/fx/cast_factory.py: one shared cast per (producer, dtype), hoisted, folded, clamped."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode

from passes import PassError
from passes._infra import ConstantRangeWarning
from passes.fx.cast_factory import Caster, _cast_name
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4, bias=False)
        self.b = nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight  # one tensor under two names


def graph(saturate: float | None = None):
    """x, two get_attr nodes of one tied weight, and ops reading them."""
    root = Tied()
    g = fx.Graph()
    x = g.placeholder("x")
    wa, wb = g.get_attr("a.weight"), g.get_attr("b.weight")
    mode = FakeTensorMode()
    with mode:
        x.meta["val"] = torch.empty(2, 4)
        wa.meta["val"] = wb.meta["val"] = torch.empty(4, 4)
        h = g.call_function(torch.ops.aten.mm.default, (x, wa))
        h.meta["val"] = torch.empty(2, 4)
    if saturate is not None:
        h.meta["amp_saturate"] = saturate
    g.output(h)
    return fx.GraphModule(root, g), mode, (x, wa, wb, h)


def test_one_cast_per_producer_and_dtype_tied_weights_once():
    gm, mode, (x, wa, wb, h) = graph()
    caster = Caster(gm, mode)
    c1 = caster.get(x, torch.bfloat16)
    assert caster.get(x, torch.bfloat16) is c1, "shared"
    assert caster.get(x, torch.float16) is not c1, "one per dtype"
    assert caster.get(wa, torch.bfloat16) is caster.get(wb, torch.bfloat16), "tied: one cast"
    assert caster.count == 3
    for c in (c1, caster.get(wa, torch.bfloat16)):
        assert is_amp_cast(c) and c.target is CAST and c.meta["amp_precision"] == "n/a"
        assert dtype_of(c) == c.kwargs["dtype"] and c.meta["val"] is c.args[0].meta["val"]
    gm.graph.lint()


def test_casts_of_inputs_and_parameters_are_hoisted_and_named_as_create_node_names_them():
    gm, mode, (x, wa, wb, h) = graph()
    caster = Caster(gm, mode)
    cast = caster.get(wa, torch.bfloat16)
    order = list(gm.graph.nodes)
    assert order.index(cast) < order.index(h), "before the first op"
    assert order.index(cast) == order.index(wa) + 1, "right after the parameter it casts"
    plain = gm.graph.create_node("call_function", CAST, (x,), {"dtype": torch.float16})
    assert _cast_name(gm.graph) is not None
    assert plain.name.rstrip("_0123456789") == cast.name.rstrip("_0123456789")


def test_a_cast_back_through_a_widening_cast_is_its_source():
    gm, mode, (x, wa, wb, h) = graph()
    caster = Caster(gm, mode)
    low = caster.get(x, torch.bfloat16)
    wide = caster.get(low, torch.float32)
    assert caster.get(wide, torch.bfloat16) is low, "low -> fp32 -> low is the low value"
    assert caster.count == 2


def test_mask_fills_beyond_the_range_are_clamped_before_the_cast():
    gm, mode, (x, wa, wb, h) = graph(saturate=-1e9)
    caster = Caster(gm, mode)
    with pytest.warns(ConstantRangeWarning, match="clamped to -65504"):
        cast = caster.get(h, torch.float16)
    clamp = cast.args[0]
    assert clamp.target is torch.ops.aten.clamp.default and clamp.args[0] is h
    assert clamp.meta["amp_inserted"]
    h.replace_all_uses_with(cast, delete_user_cb=lambda u: u is not clamp)
    gm.recompile()
    x_val, w = torch.full((2, 4), -1e9), torch.eye(4)
    with torch.no_grad():
        gm.a.weight.copy_(w)
        out = gm(x_val)
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert (out == torch.finfo(torch.float16).min).all()


def test_a_graph_without_inputs_or_parameters_is_refused():
    g = fx.Graph()
    g.output(g.call_function(torch.ops.aten.zeros.default, ([2],)))
    with pytest.raises(PassError, match="no inputs or parameters") as info:
        Caster(fx.GraphModule(nn.Module(), g), None)
    assert info.value.pass_name == "insert_casts"


def test_without_the_fast_path_the_casts_are_the_same():
    gm, mode, (x, *_) = graph()
    caster = Caster(gm, mode)
    caster.fast = False
    slow = caster.get(x, torch.bfloat16)
    gm2, mode2, (x2, *_) = graph()
    fast = Caster(gm2, mode2).get(x2, torch.bfloat16)
    assert (slow.name, slow.args, slow.kwargs) == (fast.name, (x,), {"dtype": torch.bfloat16})
    assert str(gm.graph) == str(gm2.graph)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gm.graph.lint()
