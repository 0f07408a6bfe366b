"""ampgraph/cli/html_report.py: the self-contained, module-first HTML page and its data."""

from __future__ import annotations

import json
import re

from ampgraph.cli.html_report import is_bookkeeping, legend, page_data, to_html
from ampgraph.cli.render import diff
from tests.ampgraph.cli.helpers import inspection


def embedded(page: str) -> dict:
    return json.loads(page.split('<script type="application/json" id="amp-data">')[1]
                      .split("</script>")[0])


def test_the_data_cannot_close_its_script_and_text_is_escaped():
    insp = inspection()
    insp.nodes[2]["reason"] = "deny & <why></script><b>"
    insp.target = "a<b>.py:f"
    page = to_html(insp)
    assert page.count("</script>") == 2
    markup = re.sub(r'<script type="application/json" id="amp-data">.*?</script>', "", page,
                    flags=re.S)  # inside the data script "<b>" is text, never markup
    assert "<b>" not in markup.replace("<body>", "")
    assert embedded(page)["s"].count("deny & <why></script><b>") == 1
    assert "<title>ampgraph inspect a&lt;b&gt;.py:f: O2 bf16</title>" in page


def test_rows_and_nodes_name_each_string_once():
    insp = inspection()
    data = page_data(insp)
    s = data["s"]
    assert len(s) == len(set(s))
    assert [[r[0], s[r[1]], s[r[2]], s[r[3]], s[r[4]], r[5], r[6]] for r in data["rows"]] == [
        ["x", "placeholder", "", "fp32", "graph input", 0, 2],
        ["mm", "aten.mm", "fc", "bf16", "allow", 0, 0],
        ['soft"max<b>', "aten.softmax", "head", "bf16", "deny & <why>", 0, 0]]
    assert len(data["v"]) == len(insp.view.nodes) and len(data["e"]) == len(insp.view.edges)


def test_a_cast_is_drawn_in_the_module_of_what_it_feeds_and_labelled_by_it():
    data = page_data(inspection())
    s = data["s"]
    casts = {n[0]: (s[n[5]], n[7]) for n in data["v"] if n[4] == "cast"}
    assert casts == {"c": ("fc", "\u2192 mm"), "w": ("fc", "\u2192 mm")}


def test_bookkeeping_ops_are_marked_for_hiding():
    assert is_bookkeeping("aten.unsqueeze.default") and is_bookkeeping("aten.sym_size.int")
    assert is_bookkeeping("getitem") and is_bookkeeping("Reshape")
    assert not is_bookkeeping("aten.linear") and not is_bookkeeping("aten.softmax.int")
    insp = inspection()
    insp.view.nodes[3].op = "aten.view.default"
    assert [n[8] for n in page_data(insp)["v"]] == [0, 0, 0, 1, 0, 0]


def test_legend_chips_one_per_precision_low_first():
    chips = re.findall(r'data-p="([^"]+)"', legend(inspection()))
    assert chips == ["bf16", "fp32", "n/a", "cast"]
    insp = inspection()
    insp.nodes[1]["precision"] = "fp8"
    assert re.findall(r'data-p="([^"]+)"', legend(insp)) == [
        "bf16", "fp8", "fp32", "n/a", "cast"]
    assert 'data-p="fp8" aria-pressed="true" style="background:#e98bd0"' in legend(insp)


def test_the_diff_section_has_the_text_diffs_numbers_coloured():
    base = inspection()
    assert "&rarr;" not in to_html(base)
    base.diff = diff(base, inspection("O1", softmax="fp32"))
    page = to_html(base)
    section = page.split('<h2 id="diff">')[1].split("<details")[0]
    assert section.startswith("O2 &rarr; O1: 1 node(s) change precision")
    for label in ("casts", "FLOP share bf16", "FLOP share fp8", "FLOP share fp32",
                  "parameters at run time", "activations (node outputs)",
                  "activations saved vs fp32"):
        assert f"<td>{label}</td>" in section, label
    assert '<td class="p" style="background:#8fd18f">bf16</td>' \
           '<td class="p" style="background:#8cb5e8">fp32</td>' in section
    assert embedded(page)["changed"] == {'soft"max<b>': "fp32"}


def test_the_page_opens_on_the_modules_and_keeps_every_row_in_its_data():
    page = to_html(inspection())
    assert page.index('<div id="tree">') < page.index('id="all-ops"')
    assert '<details id="all-ops"><summary>All 2 ops</summary>' in page
    assert "Inputs, parameters and buffers (1)" in page
    assert len(embedded(page)["rows"]) == 3 and page.endswith("</html>\n")
