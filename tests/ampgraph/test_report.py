"""ampgraph/report.py: explain and the PrecisionReport."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.report import EagerPart, PrecisionReport


def test_explain_with_inputs_on_eager_model_keeps_buffers():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))

    class Wrapper(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            return self.inner(x) if x.sum() > -1e9 else x

    w = Wrapper().train()
    net = ampgraph.compile(w, "O2", "bf16")
    stats = model[1].running_mean.clone()
    with pytest.warns(UserWarning):
        report = ampgraph.explain(net, torch.randn(4, 4))
    assert torch.equal(stats, model[1].running_mean), "explain must not update running stats"
    assert report.eager and any(r["op"] == "aten.linear" for r in report.nodes)


def test_explain_needs_a_compiled_module_and_inputs():
    with pytest.raises(TypeError, match="ampgraph.compile"):
        ampgraph.explain(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="example inputs"):
        ampgraph.explain(ampgraph.compile(nn.Linear(2, 2)))


# -- PrecisionReport on hand-made rows --------------------------------------------------------


def row(name: str, precision: str, reason: str, op: str = "aten.mm") -> dict[str, str]:
    return {"name": name, "op": op, "module": "fc", "precision": precision, "reason": reason}


def hand_report() -> PrecisionReport:
    nodes = [row("x", "fp32", "graph input", "placeholder"), row("mm", "bf16", "allow: matmul"),
             row("softmax", "fp32", "deny: softmax"), row("relu", "bf16", "follows its input"),
             row("linear", "bf16", "O2: every float op")]
    return PrecisionReport("O2", "bf16", nodes, 3, [EagerPart("head", "Head", "export failed")])


def test_summary_counts_precisions_decisions_casts_and_eager_modules():
    assert hand_report().summary == {
        "nodes": 5, "by_precision": {"bf16": 3, "fp32": 2},
        "compute_nodes": 3,  # decided by a rule: allow, deny, O2 (not inputs nor followers)
        "casts": 3, "eager_modules": ["head"]}


def test_to_dict_and_to_json_carry_every_field():
    report = hand_report()
    doc = json.loads(report.to_json())
    assert doc == json.loads(json.dumps(report.to_dict()))
    assert sorted(doc) == ["casts", "dtype", "eager", "level", "nodes", "summary"]
    assert doc["eager"] == [{"path": "head", "module_type": "Head", "reason": "export failed"}]
    assert doc["nodes"][1] == row("mm", "bf16", "allow: matmul")
    assert "\n" not in report.to_json(indent=None)


def test_str_is_a_header_the_eager_parts_and_one_line_per_node():
    lines = str(hand_report()).splitlines()
    assert lines[0] == "ampgraph O2 bf16: 5 nodes, 3 casts, by precision {'bf16': 3, 'fp32': 2}"
    assert lines[1] == "EAGER (fp32) head [Head]: export failed"
    assert lines[2].split() == ["name", "op", "module", "precision", "reason"]
    assert set(lines[3].replace(" ", "")) == {"-"}
    assert lines[5].split()[:4] == ["mm", "aten.mm", "fc", "bf16"] and len(lines) == 9
    long = PrecisionReport("O1", "fp16", [row("n" * 60, "fp16", "r" * 80)], 0)
    last = str(long).splitlines()[-1]
    assert last.startswith("n" * 40 + "  ") and last.endswith("r" * 80)  # the reason is whole


def test_explain_reports_a_compiled_module_s_last_graph():
    torch.manual_seed(0)
    net = ampgraph.compile(nn.Sequential(nn.Linear(4, 4), nn.Softmax(-1)), "O1", "bf16")
    net(torch.randn(2, 4))
    report = ampgraph.explain(net)
    assert (report.level, report.dtype, report.eager) == ("O1", "bf16", [])
    ops = {r["op"]: r["precision"] for r in report.nodes}
    assert ops["aten.linear"] == "bf16" and ops["aten.softmax.int"] == "fp32"
    assert report.casts >= 1 and report.summary["nodes"] == len(report.nodes)
