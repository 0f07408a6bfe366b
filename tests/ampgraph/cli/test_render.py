"""ampgraph.cli.render and html_report: table colours, --diff, JSON, DOT and HTML."""

from __future__ import annotations

import json

from ampgraph.cli.analysis import GraphView, ViewNode
from ampgraph.cli.html_report import layout, to_html
from ampgraph.cli.render import Inspection, diff, to_dot, to_table, use_color

# ------------------------------------------------------------------------------ rendering


def _inspection(level: str = "O2", softmax: str = "bf16") -> Inspection:
    nodes = [
        {"name": "x", "op": "placeholder", "module": "", "precision": "fp32",
         "reason": "graph input"},
        {"name": "mm", "op": "aten.mm", "module": "fc", "precision": "bf16", "reason": "allow"},
        {"name": 'soft"max<b>', "op": "aten.softmax", "module": "head", "precision": softmax,
         "reason": "deny & <why>"},
    ]
    view = GraphView(
        [ViewNode("x", "x", "placeholder", "fp32", "input"),
         ViewNode("c", "cast to bf16", "cast", "cast", "cast", "", "from x"),
         ViewNode("w", "cast to bf16", "cast", "cast", "cast", "", "fc.weight"),
         ViewNode("mm", "mm", "aten.mm", "bf16", "op", "fc"),
         ViewNode('soft"max<b>', 'soft"max<b>', "aten.softmax", softmax, "op", "head"),
         ViewNode("output", "output", "output", "n/a", "output")],
        [("x", "c"), ("c", "mm"), ("w", "mm"), ("mm", 'soft"max<b>'),
         ('soft"max<b>', "output")])
    summary = {"nodes": 3, "by_precision": {"bf16": 1, "fp32": 2}, "casts": 2,
               "matmul_conv_flops": 2048, "matmul_conv_flops_low": 2048, "low_flops_share": 1.0,
               "param_bytes_fp32": 400, "param_bytes_low": 200, "param_bytes_runtime": 600,
               "param_bytes_baseline": 400, "activation_bytes": 100,
               "activation_bytes_fp32": 160, "activation_saving": 0.375,
               "activation_peak_bytes": 50, "activation_peak_bytes_fp32": 80,
               "activation_peak_saving": 0.375, "input_shapes": [[2, 8]], "eager_modules": []}
    return Inspection("t.py:f", "torch", level, "bf16", nodes, 2, summary, view)


def test_table_colours_only_when_asked(monkeypatch):
    insp = _inspection()
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
    base, other = _inspection(), _inspection("O1", softmax="fp32")
    base.diff = diff(base, other)
    doc = json.loads(json.dumps(base.to_dict()))
    assert list(doc) == ["schema", "target", "kind", "level", "dtype", "nodes", "casts",
                         "summary", "diff"]
    assert doc["diff"]["changed"] == [{"name": 'soft"max<b>', "op": "aten.softmax",
                                       "module": "head", "from": "bf16", "to": "fp32",
                                       "reason": "deny & <why>"}]
    assert "O2 -> O1: 1 node(s) change precision" in to_table(base)


def test_dot_escapes_and_draws_casts():
    base = _inspection()
    base.diff = diff(base, _inspection("O1", softmax="fp32"))
    dot = to_dot(base)
    assert '"soft\\"max<b>" [label="soft\\"max<b>\\naten.softmax\\nbf16\\nO1: fp32"' in dot
    assert dot.count('shape="diamond"') == 2 and '"c" -> "mm";' in dot
    assert 'penwidth="3"' in dot


def test_html_escapes_everything():
    page = to_html(_inspection())
    assert "soft&quot;max&lt;b&gt;" in page and "<b>" not in page.replace("<body>", "")
    assert "deny &amp; &lt;why&gt;" in page


def test_layout_layers():
    pos, width, height = layout(_inspection().view)
    y = {k: v[1] for k, v in pos.items()}
    assert y["x"] < y["c"] < y["mm"] < y['soft"max<b>'] < y["output"]
    assert y["w"] == y["c"]  # a weight cast sits right above its consumer
    assert width > 0 and height > y["output"]
