"""ampgraph.cli.bench: the memory tracker and the results table."""

from __future__ import annotations

import torch

from ampgraph.cli import bench as _cli_bench

# ------------------------------------------------------------------------------ bench pieces


def test_storage_peak_tracks_new_storage_only():
    base = torch.zeros(1000)
    with _cli_bench._StoragePeak() as tracker:
        a = base + 1  # 4000 bytes
        a.add_(1)  # in place: nothing new
        v = a.view(10, 100)  # a view: nothing new
        b = v * 2  # 4000 more
        del a, v, b
        c = torch.ones(250)  # reuses the freed budget: peak stays 8000
    assert tracker.peak == 8000 and c.numel() == 250


def test_bench_table_reports_failed_variant():
    records = [{"name": "fp32", "median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0, "speedup": 1.0,
                "peak_bytes": 2048},
               {"name": "ampgraph O2", "error": "RuntimeError: boom"}]
    text = _cli_bench.table(records)
    assert "1.00x" in text and "2.0 KiB" in text and "failed: RuntimeError: boom" in text
