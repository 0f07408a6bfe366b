"""The model zoo (benchmarks/zoo.py) runs end to end in quick mode and writes sane JSON."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
COSINES = ("o2_eval_cos", "autocast_eval_cos", "o2_grad_cos", "autocast_grad_cos")


@pytest.mark.slow
def test_zoo_quick_mode_writes_every_field(tmp_path):
    out = tmp_path / "zoo.json"
    proc = subprocess.run([sys.executable, "benchmarks/zoo.py", "--quick", "--skip-onnx",
                           "--skip-speed", "--models", "bert,gpt2,tv_resnet18",
                           "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    rows = {r["model"]: r for r in data["models"]}
    assert set(rows) == {"bert", "gpt2", "tv_resnet18"}
    assert data["meta"]["command"].startswith("python benchmarks/zoo.py")
    for name in ("bert", "gpt2"):
        row = rows[name]
        assert row["capture"]["status"] in ("whole graph", "partly eager"), row
        assert row["errors"] == {}, row["errors"]
        for key in COSINES:
            value = row[key]
            assert isinstance(value, float) and not math.isnan(value), (name, key, value)
            assert -1.0 <= value <= 1.0 + 1e-9, (name, key, value)
            assert value > 0.9, (name, key, value)  # bf16 of a tiny model stays close
        assert "onnx_cos" not in row and "speed" not in row
    assert rows["bert"]["capture"]["status"] == "whole graph"
    assert rows["bert"]["criteria"] == {"whole graph": True, "eval": True, "grad": True,
                                        "onnx": None}
    assert "captured whole" in data["summary"]
    eager = rows["gpt2"]["capture"]["eager"]
    assert all(e["path"] and e["module_type"] and e["reason"] for e in eager)
    # a library that does not import gives a row, not a crash (torchvision is not installed)
    assert rows["tv_resnet18"]["capture"]["status"] in ("not available", "whole graph",
                                                        "partly eager")
    assert "| bert |" in proc.stdout
