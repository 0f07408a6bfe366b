"""benchmarks/compiled.py (autocast + torch.compile against O2 with a backend) runs end to
end: a tiny LLaMA (its logits and cache are the edges the runtime takes), aot_eager (no
C++ compiler: ~20 s, most of it Dynamo tracing four graphs a mode); no timing is
asserted."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_compiled_benchmark_smoke_mode_times_both_modes(tmp_path):
    out = tmp_path / "compiled.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/compiled.py", "--smoke", "--models", "llama",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["backend"] == "aot_eager" and set(data["models"]) == {"llama"}
    (repeat,) = data["models"]["llama"]["repeats"]
    for what in ("train", "infer"):
        assert set(repeat[what]) == {"autocast-compile", "O2-inductor"}
        assert all(v["median_ms"] > 0 for v in repeat[what].values())
    assert set(data["geomean"]) == {"O2-inductor"} and data["geomean"]["O2-inductor"] > 0
    assert "x = autocast-compile / mode" in proc.stdout
