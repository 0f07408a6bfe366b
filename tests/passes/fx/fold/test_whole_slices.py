"""passes/fx/fold/whole_slices.py: slices of a whole dimension are skipped, others kept."""

from __future__ import annotations

import torch
from torch import nn

from passes.fx.fold.dead_ops import drop_dead_ops
from passes.fx.fold.whole_slices import skip_whole_slices


class Slices(nn.Module):
    def forward(self, x):
        return x[:, :] * 2 + x[..., 0:] + x[:, 1:].sum() + x[:, ::2].sum()


def test_whole_slices_are_skipped_and_others_kept():
    from torch.export import Dim


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
