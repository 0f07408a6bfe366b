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
