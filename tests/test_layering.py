"""passes/ never imports ampgraph; importing either pulls in nothing heavy."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_import_passes_does_not_import_ampgraph():
    out = run("import sys, passes, passes.fx, passes.paint, passes.policy; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ampgraph'))")
    assert out == "[]"


def test_no_source_file_in_passes_mentions_an_ampgraph_import():
    pattern = re.compile(r"^\s*(from|import)\s+ampgraph", re.M)
    offenders = [p for p in (ROOT / "passes").rglob("*.py") if pattern.search(p.read_text())]
    assert offenders == []


def test_import_ampgraph_is_lean():
    out = run("import sys, ampgraph; heavy = ['transformers', 'sklearn', 'onnxruntime', "
              "'matplotlib', 'hypothesis', 'onnxconverter_common']; "
              "print([m for m in heavy if m in sys.modules])")
    assert out == "[]"
