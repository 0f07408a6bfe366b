"""see_fused_updates: a fused optimizer's step bumps its parameters' version counters."""

from __future__ import annotations

import torch

from ampgraph.runtime.fused_updates import see_fused_updates


def test_a_fused_step_bumps_versions_and_a_plain_one_is_left_alone():
    see_fused_updates()
    see_fused_updates()  # once per process: a second call installs nothing more
    fused, plain = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    for p in (fused, plain):
        p.grad = torch.ones(4)
    before = fused._version, plain._version
    torch.optim.SGD([fused], lr=0.1, fused=True).step()
    torch.optim.SGD([plain], lr=0.1, foreach=False).step()
    assert fused._version > before[0]  # the fused kernel alone would leave it unchanged
    assert plain._version == before[1] + 1  # its own in-place update, no extra bump
