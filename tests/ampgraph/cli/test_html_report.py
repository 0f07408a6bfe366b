"""ampgraph/cli/html_report.py: the self-contained HTML page and its graph layout."""

from __future__ import annotations

from ampgraph.cli.html_report import layout, to_html
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
