"""ampgraph/capture/data_reads.py: a forward writing a parameter through ``.data`` is
captured whole (Gemma 3n's AltUp clamps its coefficients so in train mode)."""

from __future__ import annotations

import torch
from torch import nn

import ampgraph
from ampgraph.capture.data_reads import traced_data_reads


class ClampsItsWeight(nn.Module):
    """Gemma 3n's ``Gemma3nTextAltUp.predict`` in small: the weight clamped through
    ``.data`` in train mode, then used."""

    def __init__(self):
        super().__init__()
        self.coefs = nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 4)

    def forward(self, x):
        if self.training:
            self.coefs.weight.data.clamp_(-0.1, 0.1)
        return self.out(self.coefs(x))


def test_a_write_through_data_is_captured_and_writes_the_parameter_as_eager():
    torch.manual_seed(0)
    model = ClampsItsWeight().train()
    ref = ClampsItsWeight().train()
    ref.load_state_dict(model.state_dict())
    x = torch.randn(3, 8)
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16").train()
    out = net(x)
    graphs, eager = net.amp_parts()
    assert not eager and len(graphs) == 1  # before: the root ran eagerly
    expected = ref(x)
    assert torch.equal(model.coefs.weight, ref.coefs.weight)  # clamped in place
    assert model.coefs.weight.abs().max() <= 0.1
    assert torch.allclose(out.float(), expected, rtol=0.02, atol=0.02)  # the clamped weight
    out.sum().backward()
    assert model.coefs.weight.grad is not None and model.out.weight.grad is not None


def test_data_is_torch_s_own_outside_the_block_and_for_real_tensors():
    p = nn.Parameter(torch.ones(2))
    with traced_data_reads():
        inside = p.data
        assert not inside.requires_grad and inside.data_ptr() == p.data_ptr()
        inside.add_(1)  # .data's own semantics: no version bump seen by autograd
    assert torch.equal(p.detach(), torch.full((2,), 2.0))
    assert "data" not in vars(torch.Tensor)
