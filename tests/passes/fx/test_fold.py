"""passes/fx/fold.py: cast chains fold where values allow, counts agree."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from passes.fx import fold_casts, verify
from passes.fx.dtypes import CAST, _widening, dtype_of, is_amp_cast
from passes.fx.fold import count_casts
from tests.helpers import make
from tests.passes.fx.helpers import check_pass


def _graph_with_chain(first, second, src_dtype):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    c1 = g.call_function(CAST, (x,), {"dtype": first})
    c2 = g.call_function(CAST, (c1,), {"dtype": second})
    g.output(g.call_function(torch.ops.aten.relu.default, (c2,)))
    gm = torch.fx.GraphModule(nn.Module(), g)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        x.meta["val"] = torch.empty(2, dtype=src_dtype)
        c1.meta["val"] = torch.empty(2, dtype=first)
        c2.meta["val"] = torch.empty(2, dtype=second)
    for c in (c1, c2):
        c.meta["amp_cast"] = True
    return gm


def test_fold_low_fp32_low_chain_but_keep_fp32_low_fp32():
    gm = _graph_with_chain(torch.float32, torch.float16, torch.float16)
    assert fold_casts(gm).modified
    assert count_casts(gm) == 0, "fp16 -> fp32 -> fp16 is the identity"
    x = torch.randn(2).half()
    torch.testing.assert_close(gm(x), x.relu())

    gm = _graph_with_chain(torch.bfloat16, torch.float32, torch.float32)
    fold_casts(gm)
    assert count_casts(gm) == 2, "fp32 -> bf16 -> fp32 rounds: never folded"
    x = torch.tensor([1.0 + 2**-12, 3.0])
    assert gm(x)[0].item() != x[0].item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["resnet", "bert_encoder"])
def test_no_foldable_chain_is_left_and_folding_again_changes_nothing(name, dtype):
    model, inputs = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm, result = check_pass(model, inputs, "O2", dtype)
    for cast in (n for n in gm.graph.nodes if is_amp_cast(n) and n.target is CAST):
        src, target = cast.args[0], cast.kwargs["dtype"]
        assert dtype_of(src) != target, f"{cast}: a cast to its source's own dtype"
        if is_amp_cast(src):
            assert not (dtype_of(src.args[0]) == target and _widening(target, dtype_of(src))), \
                f"{cast}: low -> fp32 -> low left"
    with torch.no_grad():
        before = gm(*inputs)
    assert not fold_casts(gm).modified
    assert count_casts(gm) == result.casts
    gm.graph.lint()
    verify(gm, dtype)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), before, rtol=0, atol=0)


class RMSNormThenLinear(nn.Module):
    """HF's LlamaRMSNorm: ``x.to(float32)`` normalised, then ``weight * h.to(x.dtype)``; in
    an fp32 model that last cast is to fp32, and O2's low ``mul`` reads the low value."""

    def __init__(self):
        super().__init__()
        self.weight, self.fc = nn.Parameter(torch.ones(16)), nn.Linear(16, 16)

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
        h = self.weight * h.to(x.dtype)
        return torch.nn.functional.dropout(self.fc(h), 0.5, training=True)


def test_ops_the_rewrite_left_unused_are_dropped_but_random_draws_stay():
    from passes.fx import drop_dead_ops, run_amp_passes
    from passes.fx.policy import make_policy
    from tests.passes.fx.helpers import export

    model, x = RMSNormThenLinear(), torch.randn(2, 5, 16)
    gm = export(model, (x,))
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    dead = [n for n in gm.graph.nodes if not n.users and n.op == "call_function"]
    assert dead == [], "the model's cast to fp32 beside the low mul is gone"
    g = gm.graph
    (drop,) = [n for n in g.nodes if "dropout" in str(n.target)]
    with g.inserting_after(drop):  # an unused draw and an unused pure op
        unused_draw = g.call_function(torch.ops.aten.rand.default, ([3],), {})
        g.call_function(torch.ops.aten.relu.default, (drop,), {})
    assert drop_dead_ops(gm).modified
    assert unused_draw in g.nodes, "a random draw keeps its place in the RNG stream"
    assert sum(1 for n in g.nodes if n.target == torch.ops.aten.relu.default) == 0


class PerLayerPositions(nn.Module):
    """Each layer builds the same position range and mask, as an exported HF model does."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            pos = torch.arange(x.shape[1]).unsqueeze(0).unsqueeze(-1)
            x = layer(x) + pos.to(x.dtype) * 0.01 + torch.rand(x.shape[0], 1, 1) * 0
        return x


def test_duplicate_pure_ops_are_computed_once_but_random_draws_and_mutated_graphs_stay():
    from passes.fx import merge_duplicate_ops
    from tests.passes.fx.helpers import export

    x = torch.randn(2, 5, 8)

    def count(gm, name):
        return sum(1 for n in gm.graph.nodes if name in str(n.target))

    gm = export(PerLayerPositions(), (x,))
    assert count(gm, "arange") == 3 and count(gm, "rand.") == 3
    torch.manual_seed(0)
    before = gm(x)
    assert merge_duplicate_ops(gm).modified
    assert count(gm, "arange") == 1, "one range for the three layers"
    assert count(gm, "rand.") == 3, "each draw (same arguments) keeps its place in the RNG"
    torch.manual_seed(0)
    torch.testing.assert_close(gm(x), before, rtol=0, atol=0)
    gm.graph.lint()

    gm = export(PerLayerPositions(), (x,))
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    with gm.graph.inserting_before(out):  # an in-place op anywhere: nothing is merged
        gm.graph.call_function(torch.ops.aten.add_.Tensor, (out.args[0][0], 1.0))
    assert not merge_duplicate_ops(gm).modified


class Slices(nn.Module):
    def forward(self, x):
        return x[:, :] * 2 + x[..., 0:] + x[:, 1:].sum() + x[:, ::2].sum()


def test_whole_slices_are_skipped_and_others_kept():
    from torch.export import Dim

    from passes.fx import drop_dead_ops, skip_whole_slices

    x = torch.randn(3, 4)  # dynamic sizes, as ampgraph exports: whole slices stay in the graph
    gm = torch.export.export(Slices(), (x,), dynamic_shapes=({0: Dim.AUTO, 1: Dim.AUTO},),
                             strict=False).module()

    def slices():
        return [tuple(n.args[2:]) for n in gm.graph.nodes
                if n.target == torch.ops.aten.slice.Tensor]

    assert len(slices()) >= 4
    assert skip_whole_slices(gm).modified
    drop_dead_ops(gm)
    assert sorted(slices()) == [(0, 9223372036854775807, 2), (1, 9223372036854775807)]
    torch.testing.assert_close(gm(x), Slices()(x))


class Lookalikes(nn.Module):
    """Ops equal under Python's ``==`` but not as ops, and per-layer states it returns."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, ids, x):
        h = self.a(x) * 2.0 + self.b(x) * 2  # the same "2", one float and one int
        states = [torch.zeros(2, 4) for _ in range(3)]
        return ids * 2.0, ids * 2, h, states, x.sum(-1), x.sum(-1)


def test_merging_keeps_scalar_types_and_never_shares_returned_values():
    from passes.fx import merge_duplicate_ops

    ids, x = torch.arange(6).view(2, 3), torch.randn(2, 4)
    gm = torch.export.export(Lookalikes(), (ids, x), strict=False).module()
    merge_duplicate_ops(gm)
    f, i, _, states, s1, s2 = gm(ids, x)
    assert f.dtype == torch.float32 and i.dtype == torch.int64
    assert len({id(t) for t in states}) == 3 and s1 is not s2
    states[0].add_(1)
    assert states[1].sum() == 0, "an output written in place leaves the others alone"


class Gram(nn.Module):
    def forward(self, h):
        return h @ h.T


class TwoModules(nn.Module):
    def __init__(self):
        super().__init__()
        self.precise, self.fast, self.fc = Gram(), Gram(), nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        return self.precise(h) + self.fast(h)


def test_with_module_overrides_ops_of_different_modules_are_not_merged():
    """A module override decides per module: merging would paint one module's op as the
    other's. With overrides (``by_module``) equal ops merge only within a module."""
    from passes.fx import merge_duplicate_ops

    model, x = TwoModules(), torch.randn(3, 4)

    def matmuls(by_module):
        gm = torch.export.export(model, (x,), strict=False).module()
        merge_duplicate_ops(gm, by_module=by_module)
        return sum(1 for n in gm.graph.nodes if n.target == torch.ops.aten.matmul.default)

    assert matmuls(by_module=False) == 1
    assert matmuls(by_module=True) == 2
