"""The runtime's dropout (ampgraph.runtime.cpu.dropout): aten's dropout but for the draw."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.runtime.cpu.dropout import amp_dropout, keep_mask

BF16 = torch.bfloat16


@pytest.mark.parametrize("keep", [0.9, 0.5, 0.1])
def test_the_mask_keeps_each_element_with_the_asked_probability(keep):
    torch.manual_seed(0)
    mask = keep_mask((4, 512, 1024), keep)
    assert mask.dtype == torch.bool
    n = mask.numel()
    assert abs(mask.float().mean().item() - keep) < 5 * (keep * (1 - keep) / n) ** 0.5
    rows = mask.float().mean(-1).flatten()  # no structure along the rows either
    assert abs(rows.std().item() - (keep * (1 - keep) / 1024) ** 0.5) < 0.003


@pytest.mark.parametrize("keep", [0.9, 0.1, 2 ** -8, 0.002])
def test_both_elements_of_a_draw_keep_with_the_asked_probability_independently(keep):
    """Two elements come from each 31-bit draw (its low 16 bits and its high 15) down to a
    keep probability of 2**-8; below it (0.002), one."""
    torch.manual_seed(0)
    mask = keep_mask((2, 1000, 1001), keep).flatten()  # an odd count: half a draw unused
    assert mask.numel() == 2 * 1000 * 1001
    for part in (mask[0::2], mask[1::2]):
        assert abs(part.float().mean().item() - keep) < 5 * (keep * (1 - keep) / part.numel()
                                                             ) ** 0.5
    both, pairs = (mask[0::2] & mask[1::2]).float().mean().item(), mask.numel() // 2
    assert abs(both - keep ** 2) < 5 * (keep ** 2 * (1 - keep ** 2) / pairs) ** 0.5


def test_the_mask_keeps_everything_at_keep_one_and_nothing_near_zero():
    assert keep_mask((1000,), 1.0).all()  # the threshold 2**31 itself does not fit an int32
    assert keep_mask((1000,), 1 - 1e-12).all()
    assert not keep_mask((1000,), 1e-12).any()
    x = torch.ones(1000, dtype=BF16)
    assert torch.equal(amp_dropout(x, 1e-12, True), torch.dropout(x, 1e-12, True))


def test_the_mask_is_reproducible_under_a_seed():
    torch.manual_seed(3)
    a = keep_mask((64, 64), 0.7)
    torch.manual_seed(3)
    assert torch.equal(a, keep_mask((64, 64), 0.7))
    assert not torch.equal(a, keep_mask((64, 64), 0.7))  # the generator moved on


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_dropout_is_aten_s_but_for_the_draw(dtype):
    """The kept values are scaled by aten's ``1 / (1 - p)`` in the input's dtype, and the
    gradient is the output gradient times that noise."""
    x = torch.randn(8, 300, dtype=dtype, requires_grad=True)
    torch.manual_seed(5)
    out = amp_dropout(x, 0.1, True)
    torch.manual_seed(5)
    noise = keep_mask(x.shape, 0.9).to(dtype).div_(0.9)
    assert torch.equal(out, x * noise)
    ones = torch.ones(1000, dtype=dtype)  # the same scale as aten's, however rounded
    assert set(amp_dropout(ones, 0.1, True).tolist()) == set(
        torch.dropout(ones, 0.1, True).tolist()) == {0.0, torch.tensor(1 / 0.9, dtype=dtype)
                                                     .item()} != {0.0, 1 / 0.9}
    grad = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, grad)
    assert torch.equal(gx, grad * noise)


def test_other_calls_are_aten_s():
    x = torch.randn(4, 8, dtype=BF16)
    assert amp_dropout(x, 0.1, False) is torch.dropout(x, 0.1, False)  # eval: x itself
    assert torch.equal(amp_dropout(x, 0.0, True), x)
    assert torch.equal(amp_dropout(x, 1.0, True), torch.zeros_like(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.drop, self.out = nn.Linear(16, 32), nn.Dropout(0.25), nn.Linear(32, 4)

    def forward(self, x):
        return self.out(self.drop(torch.relu(self.fc(x))))


def test_o2_routes_training_dropout_and_reports_it():
    torch.manual_seed(0)
    model = Net()
    net = ampgraph.compile(model, "O2", BF16)
    x = torch.randn(64, 16)
    runs = []
    for _ in range(2):
        torch.manual_seed(9)
        runs.append(net(x))
    assert torch.equal(*runs)  # reproducible under a seed
    hidden = ampgraph.compile(nn.Sequential(model.fc, model.drop), "O2", BF16)(x)
    assert abs((hidden == 0).float().mean().item() - 0.25) < 0.05  # p = 0.25 dropped
    gm = net._amp_last.captured.gm
    (node,) = [n for n in gm.graph.nodes if n.target is amp_dropout]
    assert node.meta["amp_orig_op"] == "aten.dropout" and "draws its mask" in node.meta[
        "amp_reason"]
    runs[0].sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    model.eval()
    with torch.no_grad():  # no dropout in eval: the same as eager autocast's
        with torch.autocast("cpu", BF16):
            want = model(x)
        torch.testing.assert_close(net(x), want.float(), rtol=0, atol=0)


def test_a_torch_compile_backend_keeps_aten_s_dropout():
    net = ampgraph.compile(Net(), "O2", BF16, backend="aot_eager")
    net(torch.randn(4, 16))
    targets = [n.target for _, c in net.amp_parts()[0] for n in c.gm.graph.nodes]
    assert torch.ops.aten.dropout.default in targets and amp_dropout not in targets
