"""passes/fx/costs.py: FLOPs and bytes of rewritten FX graphs, against hand counts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from passes.costs import GraphCosts
from passes.fx import run_amp_passes
from passes.fx.costs import graph_costs, live_peak, node_flops, out_bytes, tensor_bytes
from passes.fx.policy import make_policy
from tests.passes.fx.helpers import export


def flops_of(model, *inputs) -> list[int]:
    return [f for n in export(model, inputs).graph.nodes if (f := node_flops(n))]


class Attention(nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v)


class Chain(nn.Module):
    def forward(self, x):
        a = torch.relu(x)
        return a.view(-1) * 2 + 1  # the view aliases relu's output


def test_matmul_conv_and_attention_flops_are_twice_the_multiply_adds():
    assert flops_of(nn.Linear(64, 128), torch.randn(8, 64)) == [2 * 8 * 128 * 64]
    # each output point of a 3x3 convolution over 3 channels takes 27 multiply-adds
    assert flops_of(nn.Conv2d(3, 8, 3, padding=1), torch.randn(1, 3, 8, 8)) == \
        [2 * (8 * 8 * 8) * 27]
    # transposed: each input point feeds 3 output channels x 3 x 3
    assert flops_of(nn.ConvTranspose2d(8, 3, 3, stride=2), torch.randn(1, 8, 4, 4)) == \
        [2 * (8 * 4 * 4) * 27]
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 16)
    assert flops_of(Attention(), q, k, v) == [2 * 2 * 4 * 6 * (8 + 16)]  # scores + values
    assert flops_of(Chain(), torch.randn(4, 8)) == []  # elementwise ops count nothing


def test_live_peak_frees_each_value_after_its_last_use_and_views_alias():
    gm = export(Chain(), (torch.randn(4, 8),))
    assert live_peak(gm) == 2 * 4 * 8 * 4  # never more than two (4, 8) fp32 values live


def test_costs_of_a_rewritten_linear():
    gm = export(nn.Linear(64, 128), (torch.randn(8, 64),))
    before = graph_costs([gm])
    assert before == GraphCosts(131072, 0, 33280, 0, 33280, 4096, 4096, 6144, 6144)
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    after = graph_costs([gm])
    assert after.flops == after.low_flops == 131072  # the linear runs in bf16
    assert after.param_bytes_fp32 == (128 * 64 + 128) * 4  # the masters
    assert after.param_bytes_low == (128 * 64 + 128) * 2  # the bf16 copies
    # the input's bf16 cast, the bf16 linear output and its fp32 output cast
    assert after.activation_bytes == 8 * 64 * 2 + 8 * 128 * 2 + 8 * 128 * 4
    assert after.activation_bytes_fp32 == 8 * 128 * 4  # the captured graph: the output only
    assert (after.peak_bytes, after.peak_bytes_fp32) == (6144, 6144)
    linear = next(n for n in gm.graph.nodes if n.name == "linear")
    assert (out_bytes(linear), out_bytes(linear, original=True)) == (2048, 4096)
    assert tensor_bytes(linear.meta["val"], torch.float16) == 2048 and tensor_bytes(3) == 0


def test_costs_over_several_graphs_add_up_and_take_the_largest_peak():
    one = export(nn.Linear(64, 128), (torch.randn(8, 64),))
    two = export(nn.Linear(64, 128), (torch.randn(16, 64),))
    a, b, both = graph_costs([one]), graph_costs([two]), graph_costs([one, two])
    assert both.flops == a.flops + b.flops
    assert both.peak_bytes == max(a.peak_bytes, b.peak_bytes) == b.peak_bytes
    assert both.param_bytes_fp32 == a.param_bytes_fp32  # same parameter names: counted once
