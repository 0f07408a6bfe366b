"""benchmarks/kernel_counts.py runs end to end on a one-layer ViT (a few seconds), and its
counter counts what its docstring says (kernels, casts, allocations, syncs)."""

from __future__ import annotations

import json
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import kernel_counts  # noqa: E402


def test_counter_leaves_out_views_allocations_and_host_ops_and_counts_casts():
    x = torch.ones(4, 4)
    with kernel_counts.KernelCounter() as counter:
        y = x.view(16)  # a view: no kernel
        z = (y + 1).to(torch.bfloat16)  # add + a cast
        torch.empty(3)  # an allocation
        z.sum().item()  # sum is a kernel; item a host sync
        z.to(torch.int32)  # a copy, not between float dtypes: no cast
    assert dict(counter.kernels) == {"add": 1, "_to_copy": 2, "sum": 1}
    assert counter.totals() == {"kernels": 4, "casts": 1, "allocs": 1, "syncs": 1}


def test_smoke_run_prints_the_table_and_writes_the_totals(tmp_path, capsys):
    out = tmp_path / "counts.json"
    assert kernel_counts.main(["--smoke", "--models", "vit", "--diff", "--json", str(out)]) == 0
    entry = json.loads(out.read_text())["models"]["vit"]
    assert all(entry[m]["kernels"] > 0 for m in ("autocast", "O2", "floor"))
    assert entry["O2/floor"] == round(entry["O2"]["kernels"] / entry["floor"]["kernels"], 3)
    assert entry["O2-floor casts"] == entry["O2"]["casts"] - entry["floor"]["casts"]
    printed = capsys.readouterr().out
    assert "vit: per train step" in printed and "O2 - floor kernels:" in printed
