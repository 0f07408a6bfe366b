"""How the passes scale with graph size: synthetic aten graphs of 1k, 10k and 50k nodes.

    python benchmarks/compile_scaling.py [--sizes 1000,10000,50000] [--json FILE]

Graphs are traced with make_fx (fake tensors, aten ops, metadata as torch.export gives):
blocks of linear -> gelu -> layer_norm -> residual add -> softmax-weighted mix, sharing a
few weights. Reports the time of each pass and microseconds per graph node.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.fx.experimental.proxy_tensor import make_fx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from passes.fx.casts import annotate, fold_casts, insert_casts  # noqa: E402
from passes.fx.graph import build_dataflow, prepare  # noqa: E402
from passes.fx.verify import verify  # noqa: E402
from passes.paint import paint  # noqa: E402
from passes.policy import make_policy  # noqa: E402

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


def time_passes(gm: torch.fx.GraphModule, level: str = "O2") -> dict:
    policy = make_policy(level)
    t = {}
    t0 = time.perf_counter()
    prepare(gm)
    t["prepare"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    graph = build_dataflow(gm)
    t["build_dataflow"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    decisions = paint(graph, policy)
    t["paint"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    annotate(gm, decisions)
    insert_casts(gm, torch.bfloat16)
    t["insert_casts"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    fold_casts(gm)
    verify(gm, torch.bfloat16)
    t["fold+verify"] = time.perf_counter() - t0
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1000,10000,50000")
    p.add_argument("--json", default="bench_results/compile_scaling.json")
    args = p.parse_args(argv)
    rows = []
    print(f"{'nodes':>8}{'total s':>10}{'us/node':>10}  per pass (s)")
    for size in (int(s) for s in args.sizes.split(",")):
        gm = synthetic(size)
        n = len(gm.graph.nodes)
        t = time_passes(gm)
        total = sum(t.values())
        rows.append({"nodes": n, "total_s": total, "us_per_node": 1e6 * total / n, **t})
        print(f"{n:>8}{total:>10.2f}{1e6 * total / n:>10.1f}  "
              + " ".join(f"{k}={v:.2f}" for k, v in t.items()))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
