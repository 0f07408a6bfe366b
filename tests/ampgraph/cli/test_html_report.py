"""ampgraph/cli/html_report.py: the self-contained HTML page and its graph layout."""

from __future__ import annotations

import re

from ampgraph.cli.html_report import CAST_W, layout, to_html, to_svg
from ampgraph.cli.render import diff
from tests.ampgraph.cli.helpers import inspection


def test_html_escapes_everything():
    page = to_html(inspection())
    assert "soft&quot;max&lt;b&gt;" in page and "<b>" not in page.replace("<body>", "")
    assert "deny &amp; &lt;why&gt;" in page


def test_layout_layers():
    pos, width, height = layout(inspection().view)
    y = {k: v[1] for k, v in pos.items()}
    assert y["x"] < y["c"] < y["mm"] < y['soft"max<b>'] < y["output"]
    assert y["w"] == y["c"]  # a weight cast sits right above its consumer
    assert width > 0 and height > y["output"]


def test_svg_draws_every_node_and_edge_with_links_to_the_table():
    insp = inspection()
    svg = to_svg(insp)
    assert svg.startswith("<svg ") and svg.endswith("</svg>")
    assert svg.count('<g class="node') == len(insp.view.nodes) == 6
    assert svg.count('class="edge"') == len(insp.view.edges)
    assert svg.count(f'width="{CAST_W}"') == 2  # the two casts are narrower
    assert '<a href="#row-1">' in svg  # mm's node links to its table row
    assert 'data-search="mm aten.mm fc bf16"' in svg


def test_a_diff_marks_changed_nodes_and_adds_its_table():
    base = inspection()
    assert '<g class="node changed"' not in to_svg(base) and "&rarr;" not in to_html(base)
    base.diff = diff(base, inspection("O1", softmax="fp32"))
    assert to_svg(base).count('<g class="node changed"') == 1
    page = to_html(base)
    assert "O2 &rarr; O1: 1 node(s) change precision" in page
    assert "<td>bf16</td><td>fp32</td>" in page


def test_the_page_has_a_row_per_node_and_a_legend_per_precision():
    page = to_html(inspection())
    assert page.count('<tr id="row-') == 3 and page.endswith("</html>\n")
    legend = page.split('<p class="legend">')[1].split("</p>")[0]
    assert re.findall(r">([^<]*)</span>", legend) == ["bf16", "cast", "fp32", "n/a"]


def test_layout_puts_parallel_nodes_side_by_side_without_overlap():
    pos, width, _ = layout(inspection().view)
    row = sorted((x, w) for k, (x, y, w) in pos.items() if y == pos["c"][1])
    assert len(row) == 2  # the input's cast and the weight's cast
    (x1, w1), (x2, _) = row
    assert x1 + w1 < x2 and max(x + w for x, _, w in pos.values()) < width
