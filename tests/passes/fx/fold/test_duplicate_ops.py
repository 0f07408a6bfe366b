"""passes/fx/fold/duplicate_ops.py: pure ops computed once per distinct typed arguments."""

from __future__ import annotations

import torch
import torch.fx.traceback as fx_traceback
from torch import nn

from passes.fx.checkpoints import REGION_KEY
from passes.fx.fold.duplicate_ops import merge_duplicate_ops
from tests.passes.fx.helpers import export


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

    model, x = TwoModules(), torch.randn(3, 4)

    def matmuls(by_module):
        gm = torch.export.export(model, (x,), strict=False).module()
        merge_duplicate_ops(gm, by_module=by_module)
        return sum(1 for n in gm.graph.nodes if n.target == torch.ops.aten.matmul.default)

    assert matmuls(by_module=False) == 1
    assert matmuls(by_module=True) == 2


class TwoRmsNorms(nn.Module):
    """The same RMSNorm of ``x`` twice, both returned (a fuzzer's program)."""

    def forward(self, x):
        def rms(v):
            return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-6)
        return rms(x), rms(x)


def test_returned_values_under_output_casts_stay_apart_so_a_second_run_changes_nothing():
    """The first run keeps the two returned products apart (the caller may write into one);
    its output casts then return them, and a second run must not merge them either."""
    from passes.fx import run_amp_passes
    from passes.fx.policy import make_policy

    gm = export(TwoRmsNorms(), (torch.randn(4, 8),))
    run_amp_passes(gm, make_policy("O2"), torch.float16)
    before = [(n.op, str(n.target), n.meta.get("amp_dtype")) for n in gm.graph.nodes]
    assert sum("aten.mul" in t for _, t, _ in before) == 2
    run_amp_passes(gm, make_policy("O2"), torch.float16)
    assert [(n.op, str(n.target), n.meta.get("amp_dtype")) for n in gm.graph.nodes] == before


class TwoRegions(nn.Module):
    """The same op on the same value in two checkpointed regions and outside them."""

    def forward(self, x):
        outs = [x.sin()]
        for rid in (0, 1):
            with fx_traceback.annotate({REGION_KEY: (rid, {})}):
                outs.append(x.sin() * (rid + 2))
        return sum(outs)


def test_ops_of_different_checkpointed_regions_are_not_merged():
    x = torch.randn(4)
    with fx_traceback.preserve_node_meta():
        gm = torch.export.export(TwoRegions(), (x,), strict=False).module()
    assert merge_duplicate_ops(gm).modified is False
    assert sum(1 for n in gm.graph.nodes if n.target is torch.ops.aten.sin.default) == 3
