"""Inference linear: aten's on a cast weight against the weight cache's packed one.

    python benchmarks/packed_linear.py            # CPU, bf16, 2 threads
    python benchmarks/packed_linear.py --dtype fp16
    python benchmarks/packed_linear.py --smoke     # two small shapes: checks it runs

aten's CPU ``linear`` in bf16/fp16 reorders the weight into oneDNN's layout on every call;
``WeightCache.amp_linear`` without gradients keeps the working copy packed
(``ampgraph/runtime/cpu/packed.py``). Per shape (rows x in -> out), both are timed interleaved,
median of ``--repeats`` calls after warm-up, on the same inputs; the largest difference of
the two outputs is printed beside the times.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from ampgraph.runtime.cpu import packed  # noqa: E402
from ampgraph.runtime.cpu.weights import WeightCache  # noqa: E402

SHAPES = [(8, 64, 128), (32, 128, 128), (4, 768, 3072), (256, 256, 256), (256, 1024, 1024),
          (1024, 768, 768), (1024, 768, 3072), (1024, 3072, 768), (256, 4096, 4096)]


def _calls(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> dict:
    """The two ways of running ``linear(x, w, b)`` for an fp32 ``w`` and ``b``."""
    wl, bl, cache = w.to(x.dtype), b.to(x.dtype), WeightCache()
    return {"aten": lambda: torch.ops.aten.linear.default(x, wl, bl),
            "packed": lambda: cache.amp_linear(x, w, b)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--repeats", type=int, default=0, help="calls per shape (default: by size)")
    p.add_argument("--smoke", action="store_true", help="two small shapes, 3 calls each")
    args = p.parse_args(argv)
    shapes, args.repeats = (SHAPES[:2], 3) if args.smoke else (SHAPES, args.repeats)
    low = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if not packed._runs(low):
        print(f"this CPU's oneDNN does not run {args.dtype}: amp_linear uses aten's linear")
        return 0
    print(f"threads {torch.get_num_threads()}, {args.dtype}; median us (aten / packed)")
    for rows, k, n in shapes:
        torch.manual_seed(0)
        calls = _calls(torch.randn(rows, k).to(low), torch.randn(n, k), torch.randn(n))
        repeats = args.repeats or max(10, min(2000, int(2e9 / (rows * k * n))))
        times: dict[str, list[float]] = {name: [] for name in calls}
        with torch.no_grad():
            diff = (calls["aten"]().float() - calls["packed"]().float()).abs().max().item()
            for _ in range(max(3, repeats // 10)):
                for f in calls.values():
                    f()
            for _ in range(repeats):
                for name, f in calls.items():
                    t0 = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t0)
        a, q = (statistics.median(times[name]) * 1e6 for name in calls)
        print(f"{rows:5d} x {k:5d} -> {n:5d}: {a:9.1f} / {q:9.1f}  ({a / q:4.2f}x)  "
              f"max |diff| {diff:g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
