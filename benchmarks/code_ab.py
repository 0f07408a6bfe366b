"""O2 of two checkouts side by side: is the new code as fast as the old on the real models?

    git worktree add /tmp/before <old commit>
    python benchmarks/code_ab.py --before /tmp/before --steps 10 --json ab.json
    python benchmarks/code_ab.py --before . --smoke --steps 1     # harness check

Each model of ``benchmarks/real_models.py`` (its own ``build`` and ``user_mode``: the user's
AdamW step and an inference call, O2 bf16) runs in one process per checkout, each importing
ampgraph from its tree; the parent sends them their steps in turn (which goes first
alternates), so both see the same machine at the same time, and reports medians after two
warm-up steps and ``before / current`` per model and step (above 1: the current code is
faster). A mode-to-mode ratio against autocast moves by up to ~20% between runs on a shared
machine (docs/performance.md); two checkouts of the same mode measured this way move by a
few percent.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODELS = ("resnet50", "vit", "bert", "gpt2", "llama")


def worker(tree: str, name: str, smoke: bool) -> int:
    sys.path[:0] = [os.path.join(tree, "benchmarks"), tree]
    import torch
    from real_models import build, user_mode

    model, inputs, loss, _ = build(name, smoke, "cpu")
    mode = user_mode("O2", model, inputs, loss, torch.bfloat16, "cpu")
    for _ in range(2):
        mode.train_step()
        mode.infer()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
        t = time.perf_counter()
        mode.train_step() if line.strip() == "train" else mode.infer()
        print(f"{time.perf_counter() - t:.6f}", flush=True)
    return 0


def compare(name: str, trees: dict[str, str], steps: int, smoke: bool) -> dict:
    procs = {k: subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--worker", name, "--tree", tree]
        + (["--smoke"] if smoke else []), cwd=tree, stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True) for k, tree in trees.items()}
    try:
        for k, p in procs.items():
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"{name}: the {k} worker did not start")
        times: dict[str, list[float]] = {f"{k} {w}": [] for k in trees for w in ("train", "infer")}
        for i in range(steps):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))
            for what in ("train", "infer"):
                for k in order:
                    procs[k].stdin.write(what + "\n")
                    procs[k].stdin.flush()
                    times[f"{k} {what}"].append(float(procs[k].stdout.readline()))
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.stdin.write("quit\n")
                p.stdin.flush()
                p.wait()
    ms = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    return {"ms": ms, "before/current": {w: ms[f"before {w}"] / ms[f"current {w}"]
                                         for w in ("train", "infer")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", help="the old checkout's root")
    p.add_argument("--current", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="tiny configs: harness check")
    p.add_argument("--json")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args.tree, args.worker, args.smoke)
    if not args.before:
        p.error("--before is required")
    trees = {"before": os.path.abspath(args.before), "current": os.path.abspath(args.current)}
    out = {}
    for name in args.models.split(","):
        out[name] = r = compare(name, trees, args.steps, args.smoke)
        print(f"{name:9s} train {r['ms']['before train']:8.1f} -> {r['ms']['current train']:8.1f}"
              f" ms ({r['before/current']['train']:.3f}x)   infer "
              f"{r['ms']['before infer']:7.1f} -> {r['ms']['current infer']:7.1f} ms "
              f"({r['before/current']['infer']:.3f}x)", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trees": trees, "steps": args.steps, "models": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
