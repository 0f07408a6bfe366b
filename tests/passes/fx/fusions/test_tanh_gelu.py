"""passes/fx/fusions/tanh_gelu.py: the written-out tanh-GELU becomes aten's one gelu."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from passes.fx.pipeline import run_amp_passes
from passes.fx.policy import make_policy
from tests.helpers import cosine

aten = torch.ops.aten


def new_gelu(x):  # transformers' NewGELUActivation (GPT-2's gelu_new), verbatim
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(
        x, 3.0))))


def reordered(x):  # the same function with every product and sum written the other way
    return (1.0 + torch.tanh((0.044715 * torch.pow(x, 3.0) + x) * math.sqrt(2.0 / math.pi))
            ) * (x * 0.5)


def other_constant(x):  # not the tanh-GELU: 0.045 in the cubic term
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.045 * torch.pow(
        x, 3.0))))


def inner_read_elsewhere(x):  # the tanh also feeds another value: nothing to fuse
    t = torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0)))
    return 0.5 * x * (1.0 + t) + t.mean()


class Mlp(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.fc, self.out, self.act = nn.Linear(16, 32), nn.Linear(32, 8), act

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


def run(model, level="O2", low=torch.bfloat16):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    gm = torch.export.export(copy.deepcopy(model), (x,), strict=False).module()
    run_amp_passes(gm, make_policy(level), low)
    return gm, x


def targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("act", [new_gelu, reordered])
def test_the_written_out_tanh_gelu_becomes_one_gelu_with_the_same_values(act):
    torch.manual_seed(0)
    model = Mlp(act)
    gm, x = run(model)
    gelus = [n for n in gm.graph.nodes if n.target is aten.gelu.default]
    assert len(gelus) == 1 and gelus[0].kwargs == {"approximate": "tanh"}
    assert not {aten.tanh.default, aten.pow.Tensor_Scalar} & set(targets(gm))
    assert "tanh-GELU" in gelus[0].meta["amp_fused_from"]
    xg = x.clone().requires_grad_()
    got = gm(xg)
    got.float().sum().backward()
    xr = x.clone().requires_grad_()
    want = model(xr)
    want.sum().backward()
    assert cosine(got.float(), want) > 0.9999
    assert cosine(xg.grad, xr.grad) > 0.999
    gelu = torch.nn.functional.gelu(torch.linspace(-6, 6, 101), approximate="tanh")
    assert torch.allclose(act(torch.linspace(-6, 6, 101)), gelu, atol=1e-6)  # same function


def test_fp16_no_longer_needs_fp32_for_the_cube():
    gm, _ = run(Mlp(new_gelu), low=torch.float16)
    assert aten.gelu.default in targets(gm) and aten.pow.Tensor_Scalar not in targets(gm)


@pytest.mark.parametrize("act", [other_constant, inner_read_elsewhere])
def test_near_misses_keep_their_ops(act):
    gm, _ = run(Mlp(act))
    assert aten.gelu.default not in targets(gm) and aten.tanh.default in targets(gm)


def test_o0_runs_the_graph_s_own_ops():
    gm, _ = run(Mlp(new_gelu), level="O0")
    assert aten.gelu.default not in targets(gm) and aten.tanh.default in targets(gm)
