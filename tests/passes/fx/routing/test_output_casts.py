"""passes/fx/routing/output_casts.py: output casts call the runtime with their slot."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.passes.fx.routing.helpers import CALLS, rewritten


class TwoOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y, y.relu() + 1, x.shape[0]  # two cast-back outputs, one not a tensor


def output_cast(x, dtype, slot):
    CALLS.append(("output", slot))
    return x.to(dtype)


@pytest.mark.parametrize("keep_io_types", [True, False])
def test_output_casts_call_the_runtime_with_their_place_among_the_outputs(keep_io_types):
    model = TwoOutputs()
    x = torch.randn(3, 8)
    gm, _ = rewritten(model, x, torch.bfloat16, keep_io_types=keep_io_types,
                      output_cast=output_cast)
    calls = [n for n in gm.graph.nodes if n.target is output_cast]
    if not keep_io_types:  # nothing is cast back: nothing to route
        assert not calls
        return
    assert len(calls) == 2 and sorted(n.args[2] for n in calls) == [0, 1]
    assert all(n.args[1] == torch.float32 for n in calls)
    gm.graph.lint()
    CALLS.clear()
    y, z, n = gm(x)
    assert [c[1] for c in CALLS] == [0, 1] and n == 3
    assert y.dtype == z.dtype == torch.float32
    plain, _ = rewritten(model, x, torch.bfloat16)
    torch.testing.assert_close((y, z), plain(x)[:2], rtol=0, atol=0)
