"""ampgraph/cli/analysis.py: the summary numbers and the drawable view of a compiled model."""

from __future__ import annotations

import torch
from torch import nn

import ampgraph
from ampgraph.cli.analysis import fx_stats, fx_view, summary_numbers
from passes.costs import GraphCosts
from passes.fx.costs import graph_costs


def test_summary_numbers_add_shares_and_savings_to_the_costs():
    s = summary_numbers(GraphCosts(100, 50, 8, 4, 8, 30, 40, 10, 20))
    assert s == {
        "matmul_conv_flops": 100, "matmul_conv_flops_low": 50, "low_flops_share": 0.5,
        "param_bytes_fp32": 8, "param_bytes_low": 4, "param_bytes_runtime": 12,
        "param_bytes_baseline": 8, "activation_bytes": 30, "activation_bytes_fp32": 40,
        "activation_saving": 0.25, "activation_peak_bytes": 10,
        "activation_peak_bytes_fp32": 20, "activation_peak_saving": 0.5,
        "matmul_conv_flops_fp8": 0, "fp8_flops_share": 0.0, "param_bytes_fp8": 0,
    }
    fp8 = summary_numbers(GraphCosts(100, 20, 8, 4, 8, 30, 40, 10, 20, fp8_flops=70,
                                     param_bytes_fp8=2))
    assert fp8["fp8_flops_share"] == 0.7 and fp8["low_flops_share"] == 0.2
    assert fp8["param_bytes_fp8"] == 2 and fp8["param_bytes_runtime"] == 14
    empty = summary_numbers(GraphCosts(0, 0, 0, 0, 0, 0, 0, 0, 0))  # no division by zero
    assert (empty["low_flops_share"], empty["activation_saving"],
            empty["activation_peak_saving"]) == (0.0, 0.0, 0.0)


def compiled_mlp():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    x = torch.randn(2, 16)
    ampgraph.explain(net, x)
    return net


def test_fx_stats_renders_the_costs_of_the_compiled_graphs():
    net = compiled_mlp()
    graphs, _ = net.amp_parts()
    stats = fx_stats(graphs)
    assert stats == summary_numbers(graph_costs(c.gm for _, c in graphs))
    assert stats["matmul_conv_flops"] == 2 * 2 * (16 * 32 + 32 * 4)
    assert stats["low_flops_share"] == 1.0


def test_fx_view_draws_casts_as_their_own_nodes():
    net = compiled_mlp()
    graphs, _ = net.amp_parts()
    view = fx_view(graphs, net.amp_dtype)
    kinds = {n.kind for n in view.nodes}
    assert {"input", "op", "cast", "output"} <= kinds
    ids = {n.id for n in view.nodes}
    assert all(a in ids and b in ids for a, b in view.edges)  # edges join drawn nodes
    casts = [n for n in view.nodes if n.kind == "cast"]
    assert casts and all(n.label.startswith("cast to ") for n in casts)
    assert not any(n.op == "get_attr" for n in view.nodes)  # parameters are left out
