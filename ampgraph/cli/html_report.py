"""``ampgraph inspect --format html``: one self-contained page (inline CSS, JS and SVG; no
network access) with the coloured graph and a searchable node table.

The graph layout is a simple layered drawing: a node's layer is its longest distance from
a source, and nodes in a layer are ordered by the mean position of their predecessors
(one barycentre sweep), which keeps chains straight without graphviz.
"""

from __future__ import annotations

from html import escape

from ampgraph.cli.analysis import GraphView
from ampgraph.cli.render import COLORS, ROW_KEYS, SCHEMA, Inspection, summary_lines

NODE_W, NODE_H, CAST_W, H_GAP, V_GAP, PAD = 150, 34, 90, 18, 30, 20

_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:1.5em;
color:#222}
h1{font-size:1.3em}h2{font-size:1.1em;margin-top:1.5em}
dl.summary{display:grid;grid-template-columns:max-content auto;gap:.2em 1em}
dl.summary dt{font-weight:600}dl.summary dd{margin:0}
.legend span{display:inline-block;padding:.1em .6em;margin-right:.4em;border:1px solid #999;
border-radius:4px;font-size:.85em}
.graph{overflow:auto;max-height:70vh;border:1px solid #ccc;margin:.5em 0}
.graph text{font-size:10px;font-family:monospace;pointer-events:none}
.graph .edge{stroke:#888;fill:none;stroke-width:1}
.graph .changed rect{stroke:#d62728;stroke-width:3}
table{border-collapse:collapse;font-size:.85em;width:100%}
th,td{border-bottom:1px solid #e3e3e3;padding:.2em .5em;text-align:left;vertical-align:top}
th{background:#f4f4f4;position:sticky;top:0}
td.p{font-weight:600}
input#q{width:30em;padding:.3em;font-size:1em}
tr:target{outline:2px solid #d62728}
"""

_JS = """
(function(){
  var q=document.getElementById('q');
  function apply(){
    var t=q.value.toLowerCase();
    var rows=document.querySelectorAll('table.nodes tbody tr');
    var shown=0;
    for(var i=0;i!==rows.length;i++){
      var hit=!t||rows[i].textContent.toLowerCase().indexOf(t)!==-1;
      rows[i].style.display=hit?'':'none'; if(hit){shown++;}
    }
    document.getElementById('count').textContent=shown+' of '+rows.length+' nodes';
    var nodes=document.querySelectorAll('svg g.node');
    for(var j=0;j!==nodes.length;j++){
      var s=nodes[j].getAttribute('data-search');
      nodes[j].style.opacity=(!t||s.indexOf(t)!==-1)?1:0.15;
    }
  }
  q.addEventListener('input',apply); apply();
})();
"""


def layout(view: GraphView) -> tuple[dict[str, tuple[float, float, float]], float, float]:
    """Node id -> (x, y, width): layers by longest distance from a source (sources sit just
    above their first consumer), ordered by barycentre sweeps down, up and down again."""
    ids = [n.id for n in view.nodes]
    preds: dict[str, list[str]] = {i: [] for i in ids}
    succs: dict[str, list[str]] = {i: [] for i in ids}
    for a, b in view.edges:
        if a in preds and b in preds:
            preds[b].append(a)
            succs[a].append(b)
    depth: dict[str, int] = {}
    for i in ids:  # nodes come in topological order
        depth[i] = 1 + max((depth.get(p, -1) for p in preds[i]), default=-1)
    for i in ids:  # weight casts and other sources: right above their first consumer
        if not preds[i] and succs[i]:
            depth[i] = max(min(depth[s] for s in succs[i]) - 1, 0)
    layers: dict[int, list[str]] = {}
    for i in ids:
        layers.setdefault(depth[i], []).append(i)
    order = {i: float(k) for layer in layers.values() for k, i in enumerate(layer)}

    def sweep(levels: list[int], neighbours: dict[str, list[str]]) -> None:
        for d in levels:
            def key(i: str) -> float:
                near = [order[n] for n in neighbours[i]]
                return sum(near) / len(near) if near else order[i]

            layers[d].sort(key=key)
            order.update({i: float(k) for k, i in enumerate(layers[d])})

    down = sorted(layers)
    sweep(down, preds)
    sweep(down[::-1], succs)
    sweep(down, preds)
    width = {n.id: CAST_W if n.kind == "cast" else NODE_W for n in view.nodes}
    pos: dict[str, tuple[float, float, float]] = {}
    for d in down:
        x = PAD
        for i in layers[d]:
            pos[i] = (x, PAD + d * (NODE_H + V_GAP), width[i])
            x += width[i] + H_GAP
    w = max((x + wd for x, _, wd in pos.values()), default=0) + PAD
    h = (max(layers, default=0) + 1) * (NODE_H + V_GAP) + PAD
    return pos, w, h


def _short(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def to_svg(insp: Inspection) -> str:
    """The graph as an inline SVG element."""
    view = insp.view
    pos, w, h = layout(view)
    changed = {c["name"] for c in (insp.diff or {}).get("changed", [])}
    anchors = _anchors(insp)
    out = [f'<svg width="{w:.0f}" height="{h:.0f}" '
           f'viewBox="0 0 {w:.0f} {h:.0f}" role="img" aria-label="precision graph">',
           '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
           'markerHeight="6" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#888"/></marker>'
           '</defs>']
    for a, b in view.edges:
        if a not in pos or b not in pos:
            continue
        x1, y1, w1 = pos[a]
        x2, y2, w2 = pos[b]
        sx, sy, tx, ty = x1 + w1 / 2, y1 + NODE_H, x2 + w2 / 2, y2
        my = (sy + ty) / 2
        out.append(f'<path class="edge" d="M{sx:.0f},{sy:.0f} C{sx:.0f},{my:.0f} {tx:.0f},'
                   f'{my:.0f} {tx:.0f},{ty:.0f}" marker-end="url(#arrow)"/>')
    for n in view.nodes:
        x, y, wd = pos[n.id]
        fill = COLORS.get(n.precision, COLORS["n/a"])
        cls = "node changed" if n.kind == "op" and n.label in changed else "node"
        search = " ".join((n.label, n.op, n.module, n.precision)).lower()
        rx = 17 if n.kind in ("input", "output", "cast") else 5
        if n.kind == "cast":
            line1, line2 = n.label, n.detail if len(n.detail) <= 13 else "…" + n.detail[-12:]
        else:
            line1, line2 = _short(n.label, 22), _short(f"{n.op} {n.precision}", 24)
        tip = f"{n.label} | {n.op} | {n.module} | {n.precision} | {n.detail}"
        href = anchors.get(n.label)
        open_a, close_a = (f'<a href="#{escape(href)}">', "</a>") if href else ("", "")
        out.append(
            f'<g class="{cls}" data-search="{escape(search)}">{open_a}'
            f"<title>{escape(tip)}</title>"
            f'<rect x="{x:.0f}" y="{y:.0f}" width="{wd}" height="{NODE_H}" rx="{rx}" '
            f'fill="{fill}" stroke="#555"/>'
            f'<text x="{x + wd / 2:.0f}" y="{y + 14:.0f}" text-anchor="middle">'
            f"{escape(line1)}</text>"
            f'<text x="{x + wd / 2:.0f}" y="{y + 27:.0f}" text-anchor="middle">'
            f"{escape(line2)}</text>{close_a}</g>")
    out.append("</svg>")
    return "\n".join(out)


def _anchors(insp: Inspection) -> dict[str, str]:
    out: dict[str, str] = {}
    for i, r in enumerate(insp.nodes):
        out.setdefault(r["name"], f"row-{i}")
    return out


def to_html(insp: Inspection) -> str:
    """The whole page."""
    title = f"ampgraph inspect {insp.target}: {insp.level} {insp.dtype}"
    legend = "".join(f'<span style="background:{COLORS.get(p, COLORS["n/a"])}">{escape(p)}'
                     "</span>" for p in sorted({n.precision for n in insp.view.nodes}))
    summary = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>"
                      for k, v in summary_lines(insp))
    head = "".join(f"<th>{k}</th>" for k in ROW_KEYS)
    rows = []
    for i, r in enumerate(insp.nodes):
        p = r["precision"]
        cells = "".join(
            f'<td class="p" style="background:{COLORS.get(p, COLORS["n/a"])}">{escape(p)}</td>'
            if k == "precision" else f"<td>{escape(r[k])}</td>" for k in ROW_KEYS)
        rows.append(f'<tr id="row-{i}">{cells}</tr>')
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en">',
        "<head>",
        '<meta charset="utf-8">',
        f'<meta name="generator" content="ampgraph ({SCHEMA})">',
        f"<title>{escape(title)}</title>",
        f"<style>{_CSS}</style>",
        "</head>",
        "<body>",
        f"<h1>{escape(title)}</h1>",
        f'<dl class="summary">{summary}</dl>',
        f'<h2>Graph</h2><p class="legend">{legend} (casts are their own nodes; parameters '
        "are not drawn, their casts are)</p>",
        f'<div class="graph">{to_svg(insp)}</div>',
    ]
    if insp.diff is not None:
        parts.append(_diff_html(insp))
    parts += [
        "<h2>Nodes</h2>",
        '<p><input id="q" type="search" placeholder="filter: name, op, module, precision, '
        'reason" aria-label="filter nodes"> <span id="count"></span></p>',
        f'<table class="nodes"><thead><tr>{head}</tr></thead><tbody>{"".join(rows)}'
        "</tbody></table>",
        f"<script>{_JS}</script>",
        "</body>",
        "</html>",
    ]
    return "\n".join(parts) + "\n"


def _diff_html(insp: Inspection) -> str:
    d = insp.diff
    a, b = insp.level, d["level"]
    rows = "".join(
        f"<tr><td>{escape(c['name'])}</td><td>{escape(c['op'])}</td>"
        f"<td>{escape(c['module'])}</td><td>{escape(c['from'])}</td><td>{escape(c['to'])}</td>"
        f"<td>{escape(c['reason'])}</td></tr>" for c in d["changed"])
    return (f"<h2>{escape(a)} &rarr; {escape(b)}: {len(d['changed'])} node(s) change "
            f"precision</h2><table><thead><tr><th>name</th><th>op</th><th>module</th>"
            f"<th>{escape(a)}</th><th>{escape(b)}</th><th>reason ({escape(b)})</th></tr>"
            f"</thead><tbody>{rows}</tbody></table>")
