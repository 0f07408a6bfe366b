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

