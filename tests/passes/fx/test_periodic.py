"""passes/fx/periodic.py: sin and cos of values no matrix product made (a float timestep's
sinusoidal embedding) stay fp32 with the ops making their argument; a sine of a product is
painted as before."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampgraph
from passes.fx.periodic import ARGUMENT_REASON, REASON


class TimestepEmbedder(nn.Module):
    """diffusers' ``get_timestep_embedding`` (flip_sin_to_cos, a scale) and
    ``TimestepEmbedding`` (linear, silu, linear), then a block the embedding modulates."""

    def __init__(self, dim: int = 256, hidden: int = 64, scale: float = 2.0):
        super().__init__()
        self.dim, self.scale = dim, scale
        self.linear_1 = nn.Linear(dim, hidden)
        self.linear_2 = nn.Linear(hidden, hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x, timesteps):
        half = self.dim // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32) / half
        emb = timesteps[:, None].float() * torch.exp(exponent)[None, :]
        emb = self.scale * emb
        emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
        emb = torch.cat([emb[:, half:], emb[:, :half]], dim=-1)  # flip_sin_to_cos
        temb = self.linear_2(F.silu(self.linear_1(emb)))
        return self.proj(x) * (1 + temb[:, None, :])


class Siren(nn.Module):
    """A sine of a linear's output: the product rounded its argument already."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        return self.out(torch.sin(30.0 * self.linear(x)))


def rows(net, *args) -> dict[str, tuple[str, str]]:
    return {n["name"]: (n["precision"], n["reason"])
            for n in ampgraph.explain(net, *args).nodes}


def inputs():
    torch.manual_seed(1)
    return torch.randn(8, 4, 64), torch.rand(8) * 1000, torch.randn(8, 4, 64)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_float_timesteps_sinusoidal_embedding_stays_fp32_and_its_linears_go_low(level):
    torch.manual_seed(0)
    x, t, _ = inputs()
    net = ampgraph.compile(TimestepEmbedder(), amp_level=level, dtype="bf16")
    got = rows(net, x, t)
    assert got["sin"] == ("fp32", REASON) and got["cos"] == ("fp32", REASON)
    # the timestep times the frequencies, and the scale: the argument's ops
    for name in ("mul_1", "mul_2"):
        assert got[name][0] == "fp32" and got[name][1] in (ARGUMENT_REASON.format("sin"),
                                                         ARGUMENT_REASON.format("cos"))
    for name in ("linear", "linear_1", "linear_2"):
        assert got[name][0] == "bf16", (name, got[name])


def weight_grads(level: str) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TimestepEmbedder()
    x, t, target = inputs()
    net = model if level == "fp32" else ampgraph.compile(model, amp_level=level, dtype="bf16")
    ((net(x, t).float() - target) ** 2).mean().backward()
    return {n: model.get_parameter(n).grad for n in ("linear_1.weight", "linear_2.weight")}


def test_the_time_embedders_weight_gradients_agree_with_fp32_at_o2():
    """Painted low, the phase of sin(t * freqs) at t ~ 1000 is lost: cosine 0.93-0.94."""
    ref, got = weight_grads("fp32"), weight_grads("O2")
    for name, g in got.items():
        assert F.cosine_similarity(g.flatten(), ref[name].flatten(), dim=0) > 0.999, name


def test_a_sine_of_a_products_output_is_painted_as_before():
    net = ampgraph.compile(Siren(), amp_level="O2", dtype="bf16")
    got = rows(net, torch.randn(4, 16))
    assert got["sin"][0] == "bf16" and got["sin"][1] != REASON
    assert all(r != REASON and not r.startswith("makes the argument") for _, r in got.values())


def test_user_overrides_win():
    torch.manual_seed(0)
    x, t, _ = inputs()
    net = ampgraph.compile(TimestepEmbedder(), amp_level="O2", dtype="bf16",
                           custom_allow=["aten.sin", "aten.cos"])
    got = rows(net, x, t)
    assert got["sin"][0] == "bf16" and got["cos"][0] == "bf16"
