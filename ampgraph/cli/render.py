"""``ampgraph inspect`` output: the Inspection record, its JSON schema, the terminal table,
Graphviz DOT, and the comparison of two levels (``--diff``). HTML is in
``ampgraph.cli.html_report``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

from ampgraph.cli.analysis import GraphView

SCHEMA = "ampgraph.inspect/1"
ROW_KEYS = ("name", "op", "module", "precision", "reason")
COLORS = {"fp32": "#8cb5e8", "bf16": "#8fd18f", "fp16": "#f7b267", "fp8": "#e98bd0",
          "fp64": "#c9a0dc", "n/a": "#dddddd", "cast": "#f2e55c"}
ANSI = {"fp32": "34", "bf16": "32", "fp16": "33", "fp8": "95", "fp64": "35", "n/a": "2",
        "cast": "33;1"}


@dataclass
class Inspection:
    """Everything ``inspect`` reports about one model at one level."""

    target: str
    kind: str  # "torch" | "onnx"
    level: str
    dtype: str
    nodes: list[dict[str, str]]
    casts: int
    summary: dict[str, Any]
    view: GraphView
    diff: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The documented JSON document (schema ``ampgraph.inspect/1``, docs/cli.md)."""
        out = {"schema": SCHEMA, "target": self.target, "kind": self.kind, "level": self.level,
               "dtype": self.dtype, "nodes": [{k: r.get(k, "") for k in ROW_KEYS}
                                              for r in self.nodes],
               "casts": self.casts, "summary": self.summary}
        if self.diff is not None:
            out["diff"] = self.diff
        return out


# rows that are not computations: the graph's inputs, and its parameters and buffers
INPUT_OPS = ("placeholder", "input")
PARAM_OPS = ("get_attr", "initializer")


def is_op(row: dict[str, str]) -> bool:
    """Whether a report row is a computation (not an input, parameter or buffer)."""
    return row["op"] not in INPUT_OPS + PARAM_OPS


def summarize(nodes: list[dict[str, str]], casts: int, stats: dict[str, Any],
              **extra: Any) -> dict[str, Any]:
    """The ``summary`` object: counts (all rows, then the computations and the parameters
    apart), casts, FLOP/parameter/activation statistics, extras."""
    counts = Counter(r["precision"] for r in nodes)
    ops = Counter(r["precision"] for r in nodes if is_op(r))
    return {"nodes": len(nodes), "by_precision": dict(sorted(counts.items())),
            "ops": sum(ops.values()), "ops_by_precision": dict(sorted(ops.items())),
            "params": sum(r["op"] in PARAM_OPS for r in nodes), "casts": casts,
            **stats, **extra}


def diff(base: Inspection, other: Inspection) -> dict[str, Any]:
    """What changes from ``base``'s level to ``other``'s: nodes and summary numbers."""
    theirs = {r["name"]: r for r in other.nodes}
    ours = {r["name"] for r in base.nodes}
    changed = [{"name": r["name"], "op": r["op"], "module": r["module"],
                "from": r["precision"], "to": theirs[r["name"]]["precision"],
                "reason": theirs[r["name"]]["reason"]}
               for r in base.nodes
               if r["name"] in theirs and theirs[r["name"]]["precision"] != r["precision"]]
    keys = ("casts", "by_precision", "ops_by_precision", "matmul_conv_flops", "low_flops_share",
            "fp8_flops_share", "param_bytes_runtime", "activation_bytes", "activation_saving")
    return {
        "level": other.level, "dtype": other.dtype, "changed": changed,
        "only_in_base": [n for n in (r["name"] for r in base.nodes) if n not in theirs],
        "only_in_other": [r["name"] for r in other.nodes if r["name"] not in ours],
        "summary": {k: [base.summary.get(k), other.summary.get(k)] for k in keys},
    }


def to_json(insp: Inspection) -> str:
    return json.dumps(insp.to_dict(), indent=2) + "\n"


# ------------------------------------------------------------------------------ text


def use_color(stream: Any = None) -> bool:
    """ANSI colour only for a terminal, and never when NO_COLOR is set."""
    stream = stream or sys.stdout
    return "NO_COLOR" not in os.environ and hasattr(stream, "isatty") and stream.isatty()


def _c(text: str, precision: str, color: bool) -> str:
    code = ANSI.get(precision)
    return f"\x1b[{code}m{text}\x1b[0m" if color and code else text


def human_bytes(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def human_flops(n: int | float) -> str:
    for unit in ("", "K", "M", "G", "T"):
        if abs(n) < 1000 or unit == "T":
            return f"{n:.0f} FLOP" if not unit else f"{n:.2f} {unit}FLOP"
        n /= 1000
    return f"{n:.2f} PFLOP"  # pragma: no cover


def summary_lines(insp: Inspection) -> list[tuple[str, str]]:
    """(label, text) pairs shared by the table and the HTML page."""
    s, low = insp.summary, insp.dtype
    ops = s.get("ops_by_precision", s["by_precision"])
    counts = ", ".join(f"{k} {v}" for k, v in ops.items())
    eager = s.get("eager_modules") or []
    fp8_bytes = s.get("param_bytes_fp8", 0)
    lines = [
        ("ops", f"{s.get('ops', s['nodes'])} ({counts}); parameters and buffers "
                f"{s.get('params', 0)}, counted apart"),
        ("casts inserted", str(insp.casts)),
        ("matmul/conv FLOPs", f"{human_flops(s['matmul_conv_flops'])}: "
                              + ", ".join(f"{p} {100 * share:.1f}%"
                                          for p, share in flop_shares(s, low).items())),
        ("parameters", f"fp32 {human_bytes(s['param_bytes_fp32'])} + {low} "
                       f"{human_bytes(s['param_bytes_low'])}"
                       + (f" + fp8 {human_bytes(fp8_bytes)}" if fp8_bytes else "")
                       + f" = {human_bytes(s['param_bytes_runtime'])} at run time "
                         f"(fp32 model {human_bytes(s['param_bytes_baseline'])})"),
        ("activations", f"{human_bytes(s['activation_bytes'])} of node outputs vs "
                        f"{human_bytes(s['activation_bytes_fp32'])} in fp32 "
                        f"({_saved(s['activation_saving'])}); peak live "
                        f"{human_bytes(s['activation_peak_bytes'])} vs "
                        f"{human_bytes(s['activation_peak_bytes_fp32'])} "
                        f"({_saved(s['activation_peak_saving'])}) (estimates)"),
    ]
    if s.get("input_shapes") is not None:
        lines.append(("inputs", ", ".join("x".join(map(str, sh)) or "scalar"
                                          for sh in s["input_shapes"])))
    if insp.kind == "torch":
        lines.append(("eager (fp32)", ", ".join(f"{e['path']} ({e['reason']})" for e in eager)
                      or "none: the whole model was captured"))
    return lines


def flop_shares(summary: dict[str, Any], low: str) -> dict[str, float]:
    """The matmul/conv FLOPs' shares by precision: ``low`` (16-bit), fp8 and fp32 (the
    rest), each a fraction; all three always.

    Example:
        >>> flop_shares({"low_flops_share": 0.25, "fp8_flops_share": 0.7}, "bf16")
        {'bf16': 0.25, 'fp8': 0.7, 'fp32': 0.05}
    """
    lo, f8 = summary.get("low_flops_share", 0.0), summary.get("fp8_flops_share", 0.0)
    rest = round(1 - lo - f8, 4) if summary.get("matmul_conv_flops", 1) else 0.0
    return {low: lo, "fp8": f8, "fp32": rest}


def _saved(share: float) -> str:
    return f"{100 * share:.1f}% saved" if share >= 0 else f"{-100 * share:.1f}% more"


def _table(rows: list[tuple[str, ...]], head: tuple[str, ...], color_col: int | None,
           color: bool, caps: tuple[int, ...]) -> list[str]:
    widths = [min(max([len(h)] + [len(r[i]) for r in rows]), cap)
              for i, (h, cap) in enumerate(zip(head, caps))]

    def fmt(cells: tuple[str, ...], paint: bool) -> str:
        parts = []
        for i, (cell, w) in enumerate(zip(cells, widths)):
            text = cell if len(cell) <= w else cell[: max(w - 1, 0)] + "…"
            text = text.ljust(w) if i < len(cells) - 1 else text
            parts.append(_c(text, cell, color) if paint and i == color_col else text)
        return "  ".join(parts).rstrip()

    out = [fmt(head, False), fmt(tuple("-" * w for w in widths), False)]
    return out + [fmt(r, True) for r in rows]


def to_table(insp: Inspection, color: bool = False, width: int | None = None) -> str:
    """The readable terminal report (ANSI colours when ``color``)."""
    if width is None:
        width = shutil.get_terminal_size((160, 24)).columns if color else 10_000
    fixed = (36, 28, 28, 9)
    reason_w = max(width - sum(fixed) - 8, 30)
    s = insp.summary
    title = f"ampgraph inspect {insp.target}: {insp.level} {insp.dtype}"
    if s.get("mode"):
        title += f" ({s['mode']} mode)"
    out = [title, ""]
    rows = [tuple(r[k] for k in ROW_KEYS) for r in insp.nodes]
    out += _table(rows, ROW_KEYS, 3, color, (*fixed, reason_w))
    out += ["", "summary"]
    out += [f"  {label:<18} {text}" for label, text in summary_lines(insp)]
    if insp.diff is not None:
        out += ["", *diff_lines(insp, color, reason_w)]
    return "\n".join(out) + "\n"


def diff_lines(insp: Inspection, color: bool, reason_w: int = 80) -> list[str]:
    d = insp.diff
    a, b = insp.level, d["level"]
    out = [f"{a} -> {b}: {len(d['changed'])} node(s) change precision"]
    if d["changed"]:
        rows = [(c["name"], c["op"], c["module"], c["from"], c["to"], c["reason"])
                for c in d["changed"]]
        out += _table(rows, ("name", "op", "module", a, b, f"reason ({b})"), 4, color,
                      (36, 28, 28, 6, 6, reason_w))
    s = d["summary"]
    out.append(f"  casts {s['casts'][0]} -> {s['casts'][1]}; low-precision FLOP share "
               f"{_pct(s['low_flops_share'][0])} -> {_pct(s['low_flops_share'][1])}; "
               f"activations {human_bytes(s['activation_bytes'][0] or 0)} -> "
               f"{human_bytes(s['activation_bytes'][1] or 0)}")
    return out


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.1f}%"


# ------------------------------------------------------------------------------ DOT


def _q(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def to_dot(insp: Inspection) -> str:
    """Graphviz source: one fill colour per precision, casts as yellow diamonds."""
    changed = {c["name"]: c["to"] for c in (insp.diff or {}).get("changed", [])}
    lines = [
        "digraph ampgraph {",
        f"  label={_q(f'{insp.target}: {insp.level} {insp.dtype}, {insp.casts} casts')};",
        "  labelloc=t; rankdir=TB;",
        '  node [shape=box, style="rounded,filled", fontname="Helvetica", fontsize=10];',
        "  edge [color=\"#777777\", arrowsize=0.6];",
    ]
    for n in insp.view.nodes:
        attrs = {"fillcolor": COLORS.get(n.precision, COLORS["n/a"]),
                 "tooltip": f"{n.op} [{n.module}] {n.precision}: {n.detail}".strip()}
        label = n.label if n.kind in ("cast", "input", "output") else f"{n.label}\n{n.op}"
        if n.kind == "cast":
            attrs.update(shape="diamond", style="filled", fontsize="8")
        elif n.kind in ("input", "output"):
            attrs.update(shape="ellipse", style="filled")
        elif n.precision != "n/a":
            label += f"\n{n.precision}"
        if n.kind == "op" and n.label in changed:
            attrs.update(penwidth="3", color="#d62728")
            label += f"\n{insp.diff['level']}: {changed[n.label]}"
        body = ", ".join(f"{k}={_q(v)}" for k, v in attrs.items())
        lines.append(f"  {_q(n.id)} [label={_q(label)}, {body}];")
    lines += [f"  {_q(a)} -> {_q(b)};" for a, b in insp.view.edges]
    lines.append("  subgraph cluster_legend {")
    lines.append('    label="precision"; style=dashed; fontsize=10;')
    for p in sorted({n.precision for n in insp.view.nodes}):
        shape = "diamond" if p == "cast" else "box"
        lines.append(f"    {_q('legend:' + p)} [label={_q(p)}, shape={shape}, "
                     f"fillcolor={_q(COLORS.get(p, COLORS['n/a']))}];")
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"
