"""passes/fx/index_values.py: values computed only from buffers, constants and integer
inputs (rotary angles, masks) stay fp32; everything fed by data or parameters is painted."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from passes.fx.index_values import REASON


class Rotary(nn.Module):
    """LLaMA-style rotary embedding applied to a projected input."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))
        self.proj = nn.Linear(d, d)

    def forward(self, x, positions):
        angles = positions.float()[..., None] @ self.inv_freq[None, :]  # (b, t, d/2)
        emb = torch.cat([angles, angles], -1)
        return self.proj(x) * emb.cos() + x * emb.sin()


def run(level: str):
    torch.manual_seed(0)
    model = Rotary().eval()
    net = ampgraph.compile(model, amp_level=level, dtype="bf16")
    x = torch.randn(2, 8, 16)
    positions = torch.arange(4000, 4008).expand(2, 8)
    with torch.no_grad():
        return net, (net(x, positions) - model(x, positions)).abs().max().item()


def precisions(net) -> dict[str, tuple[str, str]]:
    return {n["name"]: (n["precision"], n["reason"]) for n in ampgraph.explain(net).nodes}


def test_rotary_angles_stay_fp32_at_o2_and_the_linear_goes_low():
    net, err = run("O2")
    rows = precisions(net)
    for name in ("cos", "sin", "matmul"):
        row = next(v for k, v in rows.items() if k.startswith(name))
        assert row == ("fp32", REASON), (name, row)
    assert next(v for k, v in rows.items() if k.startswith("linear"))[0] == "bf16"
    assert err < 0.05  # values rounded to bf16 once, angles exact


def test_without_it_the_angles_are_wrong():
    """O3 paints everything low, angles included: the error this pass prevents."""
    _, err = run("O3")
    assert err > 0.3


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_values_fed_by_data_or_parameters_are_painted_as_before(level):
    net, _ = run(level)
    reasons = [r for _, r in precisions(net).values()]
    assert reasons.count(REASON) <= 6  # to_copy/matmul/cat/cos/sin and their views only
    mul = [v for k, v in precisions(net).items() if k.startswith("mul")]
    assert mul and all(r != REASON for _, r in mul)


class ConstantProducts(nn.Module):
    """Products of a module's constant matrices (buffers), as torch.autocast runs them low."""

    def __init__(self):
        super().__init__()
        self.register_buffer("a", torch.randn(4, 8))
        self.register_buffer("b", torch.randn(8, 16))
        self.register_buffer("c", torch.randn(16, 16))
        self.register_buffer("v", torch.randn(4, 16))

    def forward(self, x):
        y = torch.linalg.multi_dot([self.a, self.b, self.c])
        return x + y + torch.linalg.vecdot(y, self.v)[:, None]


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_products_of_buffers_alone_follow_the_allow_list_as_under_autocast(level):
    model = ConstantProducts()
    x = torch.randn(4, 16)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.linalg.multi_dot([model.a, model.b, model.c]).dtype == torch.bfloat16
        assert torch.linalg.vecdot(model.c, model.c).dtype == torch.bfloat16
    net = ampgraph.compile(model, amp_level=level, dtype="bf16")
    rows = {n["name"]: (n["precision"], n["reason"]) for n in ampgraph.explain(net, x).nodes}
    for name in ("linalg_multi_dot", "linalg_vecdot"):
        assert rows[name][0] == "bf16" and rows[name][1].startswith("allow list"), rows[name]
