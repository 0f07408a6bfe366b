"""passes/fx/fold/cast_count.py: the casts the passes inserted, and only those."""

from __future__ import annotations

import torch
from torch import fx, nn

from passes.fx.fold.cast_count import count_casts
from passes.fx.pipeline import run_amp_passes
from passes.fx.policy import make_policy
from tests.passes.fx.helpers import TwoConsumers, export

CAST = torch.ops.aten._to_copy.default


def test_only_casts_marked_by_the_passes_count():
    g = fx.Graph()
    x = g.placeholder("x")
    own = g.call_function(CAST, (x,), {"dtype": torch.float16})  # the model's own cast
    ours = g.call_function(CAST, (own,), {"dtype": torch.float32})
    ours.meta["amp_cast"] = True
    g.output(ours)
    gm = fx.GraphModule(nn.Module(), g)
    assert count_casts(gm) == 1
    ours.meta["amp_cast"] = False
    assert count_casts(gm) == 0


def test_the_count_is_the_pipelines_and_reads_only():
    gm = export(TwoConsumers(), (torch.randn(2, 4),))
    result = run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    code = gm.code
    assert count_casts(gm) == result.casts == sum(
        1 for n in gm.graph.nodes if n.meta.get("amp_cast")) > 0
    assert gm.code == code
    assert count_casts(export(TwoConsumers(), (torch.randn(2, 4),))) == 0
