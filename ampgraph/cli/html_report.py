"""``ampgraph inspect --format html``: one self-contained page (inline CSS, JS and data;
nothing loaded from the network), module first.

The page opens on the module tree (``ampgraph.cli.module_tree``): each module's FLOP share
by precision as a stacked bar, its ops, casts and why its fp32 ops are fp32, numbered
blocks with one plan folded into one entry. A module's ops table and its graph (layered
drawing, zoom, fit-to-width, shape and data-movement ops hidden unless asked for) are built
by the page's script when asked for, from the rows and the drawn graph embedded as JSON:
the page stays small at BERT-12 scale and every node is two clicks away. The legend's
chips filter every view by precision. With ``--diff`` the page adds the comparison of the
two levels, coloured, with everything the text diff says.
"""

from __future__ import annotations

import json
from html import escape
from importlib import resources
from typing import Any

from ampgraph.cli.module_tree import build_tree, cast_feeds, tree_data
from ampgraph.cli.render import (
    COLORS,
    INPUT_OPS,
    PARAM_OPS,
    SCHEMA,
    Inspection,
    flop_shares,
    human_bytes,
    is_op,
    summary_lines,
)

# ops that move or describe data without arithmetic: hidden from a graph unless asked for
BOOKKEEPING = frozenset(
    "view reshape _unsafe_view unsqueeze squeeze expand expand_as permute transpose t slice "
    "select narrow split split_with_sizes chunk unbind getitem sym_size sym_numel sym_stride "
    "arange _assert_tensor_metadata _assert_scalar sym_constrain_range_for_size detach alias "
    "contiguous clone lift_fresh_copy full zeros ones empty scalar_tensor _to_copy flatten "
    "unflatten as_strided Reshape Unsqueeze Squeeze Transpose Shape Gather Slice Concat "
    "Constant ConstantOfShape Identity Flatten Expand Range".split())


def is_bookkeeping(op: str) -> bool:
    """Whether an op (``aten.view.default``, ``getitem``, ONNX ``Reshape``) only moves or
    describes data.

    Example:
        >>> is_bookkeeping("aten.unsqueeze.default"), is_bookkeeping("aten.linear")
        (True, False)
    """
    parts = op.split(".")
    base = parts[1] if parts[0] == "aten" and len(parts) > 1 else parts[0]
    return base in BOOKKEEPING


class _Strings:
    """Interned strings: the page's rows and nodes name each distinct string once."""

    def __init__(self) -> None:
        self.index: dict[str, int] = {}

    def __call__(self, text: str) -> int:
        return self.index.setdefault(str(text), len(self.index))

    def table(self) -> list[str]:
        return list(self.index)


def page_data(insp: Inspection) -> dict[str, Any]:
    """What the page's script draws: rows, the drawn graph, the module tree, colours;
    strings are interned (``s``) and rows are ``[name, op, module, precision, reason,
    flops, kind]`` (kind 0: a computation, 1: a parameter or buffer, 2: an input).

    Example:
        >>> data = page_data(inspection)
        >>> data["s"][data["rows"][1][3]]
        'bf16'
    """
    s = _Strings()
    rows = [[r["name"], s(r["op"]), s(r["module"]), s(r["precision"]), s(r["reason"]),
             int(r.get("flops", 0) or 0),
             2 if r["op"] in INPUT_OPS else 1 if r["op"] in PARAM_OPS else 0]
            for r in insp.nodes]
    view = insp.view
    index = {n.id: i for i, n in enumerate(view.nodes)}
    feeds = cast_feeds(view)  # a cast is drawn in the module of the op it feeds
    nodes = []
    for n in view.nodes:
        fed = feeds.get(n.id)
        module = fed.module if fed is not None else n.module
        feed = f"\u2192 {fed.label}" if fed is not None else ""
        nodes.append([n.id, n.label, s(n.op), s(n.precision), n.kind, s(module), s(n.detail),
                      feed, int(n.kind == "op" and is_bookkeeping(n.op))])
    edges = [[index[a], index[b]] for a, b in view.edges if a in index and b in index]
    changed = {c["name"]: c["to"] for c in (insp.diff or {}).get("changed", [])}
    return {"low": insp.dtype, "rows": rows, "v": nodes, "e": edges,
            "tree": tree_data(build_tree(insp)), "changed": changed,
            "colors": COLORS, "s": s.table()}


def _asset(name: str) -> str:
    return resources.files("ampgraph.cli").joinpath("page", name).read_text(encoding="utf-8")


def _json_script(data: Any) -> str:
    text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
    return text.replace("</", "<\\/")  # never closes the script element early


def legend(insp: Inspection) -> str:
    """The precision chips (buttons that hide and show a precision in every view): the
    low dtype first, then fp8, fp32, n/a and cast, those the report has.

    Example:
        >>> legend(inspection).count("<button")
        4
    """
    present = {r["precision"] for r in insp.nodes} | {n.precision for n in insp.view.nodes}
    order = [p for p in (insp.dtype, "bf16", "fp16", "fp8", "fp32", "fp64", "n/a", "cast")
             if p in present]
    order = list(dict.fromkeys(order + sorted(present - set(order))))
    return "".join(f'<button type="button" data-p="{escape(p)}" aria-pressed="true" '
                   f'style="background:{COLORS.get(p, COLORS["n/a"])}">{escape(p)}</button>'
                   for p in order)


def to_html(insp: Inspection) -> str:
    """The whole page: one file, nothing fetched.

    Example:
        >>> Path("report.html").write_text(to_html(inspect_module(spec, m, inputs, "O2",
        ...                                                        "bf16", False)))
    """
    title = f"ampgraph inspect {insp.target}: {insp.level} {insp.dtype}"
    if insp.summary.get("mode"):
        title += f" ({insp.summary['mode']} mode)"
    summary = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>"
                      for k, v in summary_lines(insp))
    ops = sum(map(is_op, insp.nodes))
    rest = len(insp.nodes) - ops
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f'<meta name="generator" content="ampgraph ({SCHEMA})">',
        f"<title>{escape(title)}</title>",
        f"<style>{_asset('report.css')}</style>",
        "</head>",
        "<body>",
        f"<h1>{escape(title)}</h1>",
        f'<dl class="summary">{summary}</dl>',
        f'<p class="legend">{legend(insp)} <small>(click a precision to hide or show it; '
        "a bar is a module's matmul/conv FLOPs by precision)</small></p>",
        '<h2>Modules</h2><div id="tree"></div>',
    ]
    if insp.diff is not None:
        parts.append(diff_html(insp))
    parts += [
        f'<details id="all-ops"><summary>All {ops} ops</summary></details>',
        f'<details id="all-params"><summary>Inputs, parameters and buffers ({rest})'
        "</summary></details>",
        f'<script type="application/json" id="amp-data">{_json_script(page_data(insp))}'
        "</script>",
        f"<script>{_asset('report.js')}</script>",
        "</body>",
        "</html>",
    ]
    return "\n".join(parts) + "\n"


def _cell(p: Any) -> str:
    text = escape(str(p))
    return f'<td class="p" style="background:{COLORS.get(str(p), "#ffffff")}">{text}</td>'


def diff_html(insp: Inspection) -> str:
    """The ``--diff`` section: the summary numbers of both levels (casts, FLOP shares by
    precision, parameter and activation bytes, op counts) and the nodes that change
    precision, cells coloured by precision.

    Example:
        >>> base.diff = diff(base, other)
        >>> diff_html(base).startswith('<h2 id="diff">O2 &rarr; O1')
        True
    """
    d = insp.diff
    a, b = insp.level, d["level"]
    s = d["summary"]

    def shares(i: int) -> dict[str, float]:
        return flop_shares({k: v[i] if v[i] is not None else 0.0 for k, v in s.items()
                            if k in ("low_flops_share", "fp8_flops_share",
                                     "matmul_conv_flops")}, (insp.dtype, d["dtype"])[i])

    lines = [("casts", *(str(x) for x in s["casts"]))]
    for (p0, v0), (p1, v1) in zip(shares(0).items(), shares(1).items()):
        name = p0 if p0 == p1 else f"{p0} / {p1}"
        lines.append((f"FLOP share {name}", f"{100 * v0:.1f}%", f"{100 * v1:.1f}%"))
    for key, label in (("param_bytes_runtime", "parameters at run time"),
                       ("activation_bytes", "activations (node outputs)")):
        if key in s:
            lines.append((label, *(human_bytes(x or 0) for x in s[key])))
    if "activation_saving" in s:
        lines.append(("activations saved vs fp32",
                      *(f"{100 * (x or 0):.1f}%" for x in s["activation_saving"])))
    counts = s.get("ops_by_precision") or s["by_precision"]
    for p in sorted(set(counts[0] or {}) | set(counts[1] or {})):
        lines.append((f"ops {p}", str((counts[0] or {}).get(p, 0)),
                      str((counts[1] or {}).get(p, 0))))
    numbers = "".join(f"<tr><td>{escape(k)}</td><td>{escape(x)}</td><td>{escape(y)}</td>"
                      "</tr>" for k, x, y in lines)
    rows = "".join(
        f"<tr><td>{escape(c['name'])}</td><td>{escape(c['op'])}</td>"
        f"<td>{escape(c['module'])}</td>{_cell(c['from'])}{_cell(c['to'])}"
        f"<td>{escape(c['reason'])}</td></tr>" for c in d["changed"])
    only = ""
    if d.get("only_in_base") or d.get("only_in_other"):
        only = (f"<p>only at {escape(a)}: {len(d.get('only_in_base', []))} node(s); only at "
                f"{escape(b)}: {len(d.get('only_in_other', []))} node(s)</p>")
    return (f'<h2 id="diff">{escape(a)} &rarr; {escape(b)}: {len(d["changed"])} node(s) change '
            f"precision</h2>"
            f'<table class="diffsum"><thead><tr><th></th><th>{escape(a)}</th>'
            f"<th>{escape(b)}</th></tr></thead><tbody>{numbers}</tbody></table>{only}"
            f"<table><thead><tr><th>name</th><th>op</th><th>module</th>"
            f"<th>{escape(a)}</th><th>{escape(b)}</th><th>reason ({escape(b)})</th></tr>"
            f"</thead><tbody>{rows}</tbody></table>")
