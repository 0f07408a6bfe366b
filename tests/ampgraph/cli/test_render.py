"""ampgraph.cli.render: table colours, --diff, JSON and DOT."""

from __future__ import annotations

import json

from ampgraph.cli.render import diff, to_dot, to_table, use_color
from tests.ampgraph.cli.helpers import inspection

# ------------------------------------------------------------------------------ rendering


def test_table_colours_only_when_asked(monkeypatch):
    insp = inspection()
    plain = to_table(insp, color=False)
    assert "\x1b[" not in plain and "deny & <why>" in plain
    coloured = to_table(insp, color=True, width=200)
    assert "\x1b[32mbf16" in coloured and "\x1b[34mfp32" in coloured

    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(Tty())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())


def test_diff_and_json_schema():
    base, other = inspection(), inspection("O1", softmax="fp32")
    base.diff = diff(base, other)
    doc = json.loads(json.dumps(base.to_dict()))
    assert list(doc) == ["schema", "target", "kind", "level", "dtype", "nodes", "casts",
                         "summary", "diff"]
    assert doc["diff"]["changed"] == [{"name": 'soft"max<b>', "op": "aten.softmax",
                                       "module": "head", "from": "bf16", "to": "fp32",
                                       "reason": "deny & <why>"}]
    assert "O2 -> O1: 1 node(s) change precision" in to_table(base)


def test_dot_escapes_and_draws_casts():
    base = inspection()
    base.diff = diff(base, inspection("O1", softmax="fp32"))
    dot = to_dot(base)
    assert '"soft\\"max<b>" [label="soft\\"max<b>\\naten.softmax\\nbf16\\nO1: fp32"' in dot
    assert dot.count('shape="diamond"') == 2 and '"c" -> "mm";' in dot
    assert 'penwidth="3"' in dot



def test_summary_counts_computations_and_parameters_apart():
    from ampgraph.cli.render import summarize

    rows = [{"op": "placeholder", "precision": "fp32"}, {"op": "get_attr", "precision": "fp32"},
            {"op": "get_attr", "precision": "fp32"}, {"op": "aten.linear", "precision": "fp8"},
            {"op": "aten.relu", "precision": "bf16"}, {"op": "initializer", "precision": "fp16"}]
    s = summarize(rows, 3, {})
    assert s["nodes"] == 6 and s["by_precision"] == {"bf16": 1, "fp16": 1, "fp32": 3, "fp8": 1}
    assert s["ops"] == 2 and s["ops_by_precision"] == {"bf16": 1, "fp8": 1}
    assert s["params"] == 3


def test_the_flop_line_gives_all_three_precisions_and_fp8_weight_bytes():
    from ampgraph.cli.render import summary_lines

    insp = inspection()
    insp.summary.update(ops=2, ops_by_precision={"bf16": 1, "fp8": 1}, params=1,
                        matmul_conv_flops=1000, low_flops_share=0.25, fp8_flops_share=0.7,
                        param_bytes_fp8=1024, param_bytes_runtime=1624)
    lines = dict(summary_lines(insp))
    assert lines["ops"] == "2 (bf16 1, fp8 1); parameters and buffers 1, counted apart"
    assert lines["matmul/conv FLOPs"] == "1.00 KFLOP: bf16 25.0%, fp8 70.0%, fp32 5.0%"
    assert lines["parameters"] == ("fp32 400 B + bf16 200 B + fp8 1.0 KiB = 1.6 KiB at run "
                                   "time (fp32 model 400 B)")
