"""What the rendering tests share: a small hand-made Inspection with names to escape."""

from __future__ import annotations

from ampgraph.cli.analysis import GraphView, ViewNode
from ampgraph.cli.render import Inspection


def inspection(level: str = "O2", softmax: str = "bf16") -> Inspection:
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
