"""custom_allow / custom_deny / module_overrides / keep_batchnorm_fp32."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from tests.helpers import make


def precisions(net, *inputs):
    report = ampgraph.explain(net, *inputs)
    return report, {(r["module"], r["op"]): r["precision"] for r in report.nodes}


def test_custom_deny_op_name_and_full_overload():
    model, inputs = make("bert_encoder")
    for level, name in (("O2", "gelu"), ("O2", "aten.gelu"), ("O2", "aten.gelu.default"),
                        ("O3", "layer_norm")):
        net = ampgraph.compile(model, level, "bf16", custom_deny=[name])
        report, _ = precisions(net, *inputs)
        key = name.removeprefix("aten.").split(".")[0]
        rows = [r for r in report.nodes if r["op"].split(".")[:2] == ["aten", key]]
        assert rows, f"the model has {key} ops"
        for r in rows:
            assert r["precision"] == "fp32" and "custom_deny" in r["reason"]


def test_custom_allow_op_runs_low_at_o1():
    model, inputs = make("bert_encoder")
    net = ampgraph.compile(model, "O1", "bf16", custom_allow=["aten.layer_norm"])
    report, _ = precisions(net, *inputs)
    ln = [r for r in report.nodes if r["op"].startswith("aten.layer_norm")]
    assert ln and all(r["precision"] == "bf16" for r in ln)


def test_module_class_and_path_pattern():
    model, inputs = make("resnet")
    net = ampgraph.compile(model, "O3", "bf16", custom_deny=[nn.Conv2d])
    report, _ = precisions(net, *inputs)
    convs = [r for r in report.nodes if r["op"].startswith("aten.conv2d")]
    assert convs and all(r["precision"] == "fp32" for r in convs)

    model, inputs = make("bert_encoder")
    net = ampgraph.compile(model, "O2", "bf16", module_overrides={"layers.*.attn": "fp32"})
    report, _ = precisions(net, *inputs)
    attn = [r for r in report.nodes if ".attn" in r["module"] and r["op"].startswith("aten.")]
    assert attn, sorted({r["module"] for r in report.nodes})
    assert all(r["precision"] in ("fp32", "n/a") for r in attn)
    assert any(r["precision"] == "bf16" for r in report.nodes if ".attn" not in r["module"])


def test_module_override_pins_classifier_fp32():
    model, inputs = make("tabular_mlp")
    head = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)][-1]
    net = ampgraph.compile(model, "O3", "bf16", module_overrides={head: "fp32"})
    report, _ = precisions(net, *inputs)
    rows = [r for r in report.nodes if r["module"] == head and r["op"] == "aten.linear"]
    assert rows and rows[0]["precision"] == "fp32" and "module_overrides" in rows[0]["reason"]


def test_keep_batchnorm_fp32_overrides_level_default():
    model, inputs = make("resnet")
    _, p3 = precisions(ampgraph.compile(model, "O3", "bf16"), *inputs)
    _, p3k = precisions(ampgraph.compile(model, "O3", "bf16", keep_batchnorm_fp32=True), *inputs)
    _, p2 = precisions(ampgraph.compile(model, "O2", "bf16", keep_batchnorm_fp32=False), *inputs)
    bn = [k for k in p3 if k[1].startswith("aten.batch_norm")]
    assert bn
    assert {p3[k] for k in bn} == {"bf16"}
    assert {p3k[k] for k in bn} == {"fp32"}
    assert {p2[k] for k in bn} == {"bf16"}


@pytest.mark.parametrize("kwargs", [
    {"custom_allow": ["softmax"], "custom_deny": ["aten.softmax"]},
    {"custom_allow": ["encoder.*"], "custom_deny": ["encoder.*"]},
    {"custom_allow": ["classifier"], "module_overrides": {"classifier": "fp32"}},
    {"custom_allow": [nn.Linear], "custom_deny": [nn.Linear]},
])
def test_conflicting_overrides_raise(kwargs):
    with pytest.raises(ValueError, match="conflicting overrides"):
        ampgraph.compile(nn.Linear(2, 2), "O2", "bf16", **kwargs)


def test_override_dtype_must_match_compile_dtype():
    with pytest.raises(ValueError, match="one low dtype"):
        ampgraph.compile(nn.Linear(2, 2), "O2", "bf16", module_overrides={"x": "fp16"})


def test_o0_ignores_overrides_and_runs_everything_fp32():
    model, inputs = make("tabular_mlp")
    report, p = precisions(ampgraph.compile(model, "O0", custom_allow=["aten.layer_norm"]),
                           *inputs)
    assert set(p.values()) <= {"fp32", "n/a"} and report.casts == 0
    assert torch.float32 == ampgraph.compile(model, "O0").amp_dtype
