"""passes/fx/fold/constant_casts.py: casts of the graph's own constants are made once, at
rewrite time; parameters and buffers are still cast at run time."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import passes.fx.pipeline as pipeline
from passes._infra import PassResult
from passes.fx.dtypes import is_amp_cast
from passes.fx.fold.constant_casts import fold_constant_casts
from passes.fx.policy import make_policy
from passes.fx.verify import verify
from tests.passes.fx.helpers import export

aten = torch.ops.aten


class CacheStart(nn.Module):
    """HF's DynamicCache: keys start as ``torch.tensor([])`` and the layer's keys are
    concatenated onto them; a scalar constant and a buffer meet low activations too."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x):
        keys = torch.cat([torch.tensor([]), self.fc(x).flatten()], -1)
        h = keys.view(-1, 8) * torch.tensor(3.0)
        return self.fc(h) * self.scale


def rewritten(monkeypatch, fold: bool, dtype=torch.bfloat16):
    if not fold:
        monkeypatch.setattr(pipeline, "fold_constant_casts",
                            lambda gm, recompile=True: PassResult(gm, False))
    torch.manual_seed(0)
    x = torch.randn(2, 8)
    gm = export(CacheStart(), (x,))
    pipeline.run_amp_passes(gm, make_policy("O2"), dtype)
    return gm, x


def constant_casts(gm):
    return [n for n in gm.graph.nodes if is_amp_cast(n) and "lifted" in str(n.args[0])
            or n.target is aten.lift_fresh_copy.default]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_constant_casts_are_made_once_with_the_same_values(monkeypatch, dtype):
    plain, x = rewritten(monkeypatch, False, dtype)
    monkeypatch.undo()
    gm, _ = rewritten(monkeypatch, True, dtype)
    assert constant_casts(plain), "without the pass each call copies and casts the constants"
    assert not any(n.target is aten.lift_fresh_copy.default for n in gm.graph.nodes)
    folded = [n for n in gm.graph.nodes if n.op == "get_attr"
              and n.meta.get("amp_reason", "").endswith("when the graph was rewritten")]
    assert len(folded) == 2 and {n.meta["amp_dtype"] for n in folded} == {dtype}
    for n in folded:
        value = getattr(gm.get_submodule(n.target.rpartition(".")[0]) if "." in n.target
                        else gm, n.target.rpartition(".")[2])
        assert value.dtype == dtype and type(value) is torch.Tensor
    # the buffer may change between calls: still cast at run time
    assert any(is_amp_cast(n) and n.args[0].target == "scale" for n in gm.graph.nodes)
    gm.graph.lint()
    verify(gm, dtype)
    assert torch.equal(gm(x), plain(x))
    again = pipeline.run_amp_passes(gm, make_policy("O2"), dtype)
    assert not constant_casts(gm) and again.casts == sum(is_amp_cast(n) for n in gm.graph.nodes)
    assert torch.equal(gm(x), plain(x))


def test_parameters_and_large_constants_are_not_folded(monkeypatch):
    gm, _ = rewritten(monkeypatch, False)
    big = torch.zeros(1 << 17)
    gm.big = big  # a plain attribute above MAX_NUMEL
    g = gm.graph
    first = next(iter(g.nodes))
    with g.inserting_after(first):
        read = g.create_node("get_attr", "big")
        cast = g.call_function(torch.ops.aten._to_copy.default, (read,),
                               {"dtype": torch.bfloat16})
        weight = g.create_node("get_attr", "fc.weight")
        wcast = g.call_function(torch.ops.aten._to_copy.default, (weight,),
                                {"dtype": torch.bfloat16})
    cast.meta["amp_cast"] = wcast.meta["amp_cast"] = True
    fold_constant_casts(gm)
    assert cast in g.nodes and wcast in g.nodes
