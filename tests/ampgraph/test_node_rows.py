"""ampgraph/node_rows.py: one report row per original graph node, with its precision."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.node_rows import node_rows
from passes.fx.checkpoints import UNHONOURED_KEY

KEYS = {"name", "op", "module", "precision", "reason", "flops"}


def compiled_graph(dtype: str, level: str = "O2"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.ReLU())
    net = ampgraph.compile(model, level, dtype)
    net(torch.randn(2, 4))
    ((prefix, compiled),), _ = net.amp_parts()
    assert prefix == ""
    return compiled


def test_one_row_per_original_node_and_none_for_the_inserted_casts():
    compiled = compiled_graph("bf16")
    rows = node_rows("", compiled, torch.bfloat16)
    nodes = [n for n in compiled.gm.graph.nodes if n.op != "output"]
    casts = [n.name for n in nodes if n.meta.get("amp_cast")]
    assert casts, "O2 inserts casts"
    assert [r["name"] for r in rows] == [n.name for n in nodes if n.name not in casts]
    assert all(set(r) == KEYS for r in rows)
    flops = {r["name"]: r["flops"] for r in rows}
    assert flops["linear"] == 2 * 2 * 4 * 8 and sum(flops.values()) == flops["linear"]


@pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning")
def test_precisions_are_named_by_the_low_dtype_and_fp32():
    for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16")):
        rows = {r["name"]: r for r in node_rows("", compiled_graph(name), dtype)}
        assert rows["linear"]["precision"] == name
        assert rows["linear"]["op"] == "aten.linear"
        assert rows["linear"]["reason"].startswith("allow list")
        assert rows["layer_norm"]["precision"] == "fp32"
        assert rows["_0_weight"]["precision"] == "fp32"  # the master weight


def test_modules_are_joined_to_the_prefix_and_parameters_name_their_owner():
    rows = {r["name"]: r for r in node_rows("encoder", compiled_graph("bf16"), torch.bfloat16)}
    assert rows["linear"]["module"] == "encoder.0"
    assert rows["layer_norm"]["module"] == "encoder.1"
    assert (rows["_1_bias"]["op"], rows["_1_bias"]["module"]) == ("get_attr", "encoder.1")
    assert rows["args_0"]["op"] == "placeholder" and rows["args_0"]["module"] == "encoder"
    plain = {r["name"]: r for r in node_rows("", compiled_graph("bf16"), torch.bfloat16)}
    assert plain["linear"]["module"] == "0" and plain["args_0"]["module"] == ""


def test_o0_runs_everything_in_fp32():
    rows = node_rows("", compiled_graph("bf16", level="O0"), torch.bfloat16)
    compute = [r for r in rows if r["op"].startswith("aten.")]
    assert compute and {r["precision"] for r in compute} == {"fp32"}


def test_an_activation_the_linear_applies_keeps_its_row():
    torch.manual_seed(0)
    net = ampgraph.compile(nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 2)), "O2")
    net(torch.randn(2, 4))
    ((_, compiled),), _ = net.amp_parts()
    assert not [n for n in compiled.gm.graph.nodes if n.target is torch.ops.aten.gelu.default]
    rows = node_rows("", compiled, torch.bfloat16)
    (gelu,) = [r for r in rows if r["op"] == "aten.gelu"]
    assert gelu["precision"] == "bf16" and gelu["module"] == "1"
    names = [r["name"] for r in rows]
    assert names.index(gelu["name"]) == names.index("linear") + 1  # right after its linear


def test_a_checkpointed_region_left_inline_has_a_row_saying_so():
    compiled = compiled_graph("bf16")
    compiled.gm.meta[UNHONOURED_KEY] = [{"region": 3, "module": "blocks.0", "nodes": 7,
                                         "reason": "x feeds it"}]
    try:
        row = node_rows("net", compiled, torch.bfloat16)[-1]
    finally:
        del compiled.gm.meta[UNHONOURED_KEY]
    assert row["name"] == "checkpoint_region_3" and row["op"] == "checkpoint"
    assert row["module"] == "net.blocks.0"
    assert "NOT honoured (7 nodes kept inline): x feeds it" in row["reason"]


class MadeInForward(nn.Module):
    """A tensor made in forward (torch.export lifts it as ``lifted_tensor_0``) and a size
    read outside any module (its nn_module_stack is torch's placeholder hook)."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        scale = torch.tensor([2.0, 3.0, 4.0, 5.0, 1.0, 1.0, 1.0, 1.0])
        return self.linear(x).reshape(x.shape[0], -1) * scale


def test_rows_name_no_internal_torch_export_names():
    net = ampgraph.compile(MadeInForward())
    report = ampgraph.explain(net, torch.randn(3, 8))
    text = str(report) + report.to_json()
    assert "lifted_tensor" not in text and "_empty_nn_module_stack" not in text
    assert any("forward_constant_0" in r["name"] for r in report.nodes)
