"""How the passes scale with graph size: synthetic aten graphs of 1k, 10k and 50k nodes.

    python benchmarks/compile_scaling.py [--sizes 1000,10000,50000] [--repeat N] [--json FILE]

Graphs are traced with make_fx (fake tensors, aten ops, metadata as torch.export gives):
blocks of linear -> gelu -> layer_norm -> residual add -> softmax-weighted mix, sharing a
few weights. Reports the time of each pass and microseconds per graph node.

The passes run as ``passes.fx.pipeline.run_amp_passes`` runs them (O2, bf16): prepare,
build_dataflow, the range-hazard analysis, paint, annotate + insert_casts and fold_casts
without regenerating the module's code, verify, count_casts. ``total_s``/``us_per_node``
are those passes alone. The pipeline then regenerates ``gm.forward`` once
(``gm.recompile()``, torch.fx code generation): timed separately as ``recompile``, and
included in ``total_with_recompile_s``/``us_per_node_with_recompile``.

A warm-up run on a ~100-node graph pays the process's one-time costs first (lazy imports,
first-use tables; its seconds are printed). ``--repeat N`` times each size on N fresh graphs
and reports the fastest run, the least disturbed on a shared machine, with the median.

Each size starts from a collected heap (``gc.collect()`` after tracing). As in
``run_amp_passes``, the cyclic garbage collector is paused while the passes and the
recompile run (``passes.fx.pipeline.gc_paused``); ``--gc`` keeps it on instead, as the
passes ran before: ``gc_full`` counts the full collections that fell inside the passes and
``gc_full_s`` their seconds (part of the pass times: at 50k nodes one full collection of
the ~900k-object heap of fake tensors costs ~0.8 s).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from passes.fx.dataflow import build_dataflow  # noqa: E402
from passes.fx.fold.cast_count import count_casts  # noqa: E402
from passes.fx.fold.casts import fold_casts  # noqa: E402
from passes.fx.hazards import mark_range_hazards  # noqa: E402
from passes.fx.insert_casts import annotate, insert_casts  # noqa: E402
from passes.fx.pipeline import gc_paused  # noqa: E402
from passes.fx.policy import make_policy  # noqa: E402
from passes.fx.prepare import prepare  # noqa: E402
from passes.fx.verify import verify  # noqa: E402
from passes.paint import paint  # noqa: E402

D = 16


def synthetic(nodes: int) -> torch.fx.GraphModule:
    blocks = max(1, nodes // 9)

    def f(x, w, b, g):
        for _ in range(blocks):
            h = torch.nn.functional.linear(x, w, b)
            h = torch.nn.functional.gelu(h)
            h = torch.nn.functional.layer_norm(h, (D,), g)
            x = x + h * torch.softmax(h, -1)
        return x

    args = (torch.randn(4, D), torch.randn(D, D), torch.randn(D), torch.randn(D))
    return make_fx(f, tracing_mode="fake")(*args)


class _FullCollections:
    """Counts full (generation 2) collections and their seconds while active."""

    def __init__(self) -> None:
        self.count, self.seconds, self._t0, self.active = 0, 0.0, 0.0, True

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2 or not self.active:
            return
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._t0


def time_passes(gm: torch.fx.GraphModule, level: str = "O2",
                low: torch.dtype = torch.bfloat16, watch: _FullCollections | None = None,
                pause_gc: bool = True) -> dict:
    """Seconds per pass (the pipeline's order), plus the final ``recompile``. ``watch``
    counts full collections during the passes (it stops before the recompile);
    ``pause_gc``: the collector is off meanwhile, as in ``run_amp_passes``."""
    with gc_paused() if pause_gc else contextlib.nullcontext():
        policy = make_policy(level)
        t = {}
        t0 = time.perf_counter()
        prepare(gm, recompile=False)
        t["prepare"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        graph = build_dataflow(gm)
        t["build_dataflow"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if policy.level != "O0":
            mark_range_hazards(graph, gm, low)
        t["hazards"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        decisions = paint(graph, policy)
        t["paint"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        annotate(gm, decisions)
        insert_casts(gm, low, recompile=False)
        t["insert_casts"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        fold_casts(gm, recompile=False)
        verify(gm, low)
        count_casts(gm)
        t["fold+verify"] = time.perf_counter() - t0
        if watch is not None:
            watch.active = False
        t0 = time.perf_counter()
        gm.recompile()
        t["recompile"] = time.perf_counter() - t0
    return t


def _one_run(size: int, args: argparse.Namespace) -> tuple[dict, dict]:
    """(the JSON row, seconds per pass) of timing the passes on a fresh graph."""
    gm = synthetic(size)
    n = len(gm.graph.nodes)
    gc.collect()
    full = _FullCollections()
    gc.callbacks.append(full)
    try:
        t = time_passes(gm, args.level, watch=full, pause_gc=not args.gc)
    finally:
        gc.callbacks.remove(full)
    total = sum(v for k, v in t.items() if k != "recompile")
    with_recompile = total + t["recompile"]
    return {"nodes": n, "level": args.level, "gc_paused": not args.gc, "total_s": total,
            "us_per_node": 1e6 * total / n, "total_with_recompile_s": with_recompile,
            "us_per_node_with_recompile": 1e6 * with_recompile / n, **t,
            "gc_full": full.count, "gc_full_s": full.seconds}, t


def warm_up(args: argparse.Namespace) -> float:
    """Seconds of an untimed first run on a ~100-node graph: the one-time costs of a process
    (lazy imports, first-use tables), which are not per node, are paid here."""
    t0 = time.perf_counter()
    _one_run(100, args)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1000,10000,50000")
    p.add_argument("--level", default="O2", choices=("O0", "O1", "O2", "O3"))
    p.add_argument("--json", default="bench_results/compile_scaling.json")
    p.add_argument("--repeat", type=int, default=1,
                   help="time each size on this many fresh graphs; report the fastest run "
                        "(the least disturbed on a shared machine) and the median")
    p.add_argument("--gc", action="store_true",
                   help="keep the garbage collector on while timing (run_amp_passes pauses it)")
    args = p.parse_args(argv)
    rows = []
    print(f"warm-up (one-time costs, untimed below): {warm_up(args):.2f} s")
    print(f"{'nodes':>8}{'passes s':>10}{'us/node':>10}{'+recompile':>12}{'us/node':>10}"
          "  per pass (s)")
    for size in (int(s) for s in args.sizes.split(",")):
        runs = [_one_run(size, args) for _ in range(args.repeat)]
        row, t = min(runs, key=lambda r: r[0]["total_s"])  # the least disturbed run
        row["us_per_node_runs"] = [r["us_per_node"] for r, _ in runs]
        row["us_per_node_median"] = statistics.median(row["us_per_node_runs"])
        rows.append(row)
        n, total = row["nodes"], row["total_s"]
        spread = (f" (median {row['us_per_node_median']:.1f} of {len(runs)})"
                  if len(runs) > 1 else "")
        print(f"{n:>8}{total:>10.2f}{1e6 * total / n:>10.1f}"
              f"{row['total_with_recompile_s']:>12.2f}"
              f"{row['us_per_node_with_recompile']:>10.1f}  "
              + " ".join(f"{k}={v:.2f}" for k, v in t.items())
              + f"  (full gc: {row['gc_full']}, {row['gc_full_s']:.2f} s){spread}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
