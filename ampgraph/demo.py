"""The main demo: compile a reference model at O2, train it on real data, show the plan.

Run from the repository root: ``python -m ampgraph.demo`` (``--quick`` for a short run).
It trains the reference tabular MLP on scikit-learn's bundled 8x8 digits (no download)
once in FP32 and once through ``ampgraph.compile(model, amp_level="O2")``, then prints
test accuracy, median step time of each, and what ran in which precision.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import pathlib
import statistics
import sys
import time
from typing import Any

import torch
from torch import nn

import ampgraph
from ampgraph.config import dtype_name


def load_reference_model(name: str) -> Any:
    """Import ``models/<name>.py`` from the repository (models/ is not installed)."""
    for root in (pathlib.Path.cwd(), pathlib.Path(__file__).resolve().parents[1]):
        path = root / "models" / f"{name}.py"
        if path.exists():
            spec = importlib.util.spec_from_file_location(f"ampgraph_models_{name}", path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            return module
    raise FileNotFoundError(f"models/{name}.py not found: run the demo from the repository root")


def digits() -> tuple[torch.Tensor, ...]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32) / 16.0
    y = torch.tensor(data.target, dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(len(x), generator=g)
    x, y = x[perm], y[perm]
    split = int(0.8 * len(x))
    return x[:split], y[:split], x[split:], y[split:]


def train(net: nn.Module, params: Any, data: tuple, epochs: int, batch: int) -> dict:
    xtr, ytr, xte, yte = data
    opt = torch.optim.AdamW(params, lr=2e-3)
    loss_fn = nn.CrossEntropyLoss()
    times = []
    g = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        net.train()
        perm = torch.randperm(len(xtr), generator=g)
        for i in range(0, len(xtr) - batch + 1, batch):
            idx = perm[i:i + batch]
            t0 = time.perf_counter()
            loss = loss_fn(net(xtr[idx]).float(), ytr[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
    net.eval()
    with torch.no_grad():
        acc = (net(xte).argmax(-1) == yte).float().mean().item()
    warm = times[3:] or times
    return {"accuracy": acc, "median_ms": 1000 * statistics.median(warm), "loss": loss.item()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--level", default="O2")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quick", action="store_true", help="a short run (CI smoke test)")
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.hidden = 1, 128
    torch.manual_seed(0)
    mod = load_reference_model("tabular_mlp")
    data = digits()
    base = mod.make_model(in_features=64, hidden=args.hidden, depth=3, out_features=10)

    fp32_model = copy.deepcopy(base)
    amp_model = copy.deepcopy(base)
    net = ampgraph.compile(amp_model, amp_level=args.level, dtype=args.dtype)
    print(f"ampgraph demo: tabular MLP (hidden {args.hidden}) on sklearn digits, "
          f"{args.epochs} epochs, batch {args.batch}, {torch.get_num_threads()} threads")
    print(f"compiled at {args.level}, dtype {dtype_name(net.amp_dtype)}\n")
    r32 = train(fp32_model, fp32_model.parameters(), data, args.epochs, args.batch)
    ramp = train(net, amp_model.parameters(), data, args.epochs, args.batch)

    report = ampgraph.explain(net)
    compute = [r for r in report.nodes if r["op"].startswith("aten.")]
    print(f"{'':10}{'test acc':>10}{'step ms':>10}")
    print(f"{'FP32':10}{r32['accuracy']:>10.3f}{r32['median_ms']:>10.1f}")
    print(f"{args.level:10}{ramp['accuracy']:>10.3f}{ramp['median_ms']:>10.1f}   "
          f"speed-up {r32['median_ms'] / ramp['median_ms']:.2f}x\n")
    print(f"what ran in which precision ({len(compute)} ops, {report.casts} casts inserted, "
          f"parameters stay fp32):")
    for r in compute:
        print(f"  {r['precision']:5} {r['op']:28} {r['module']:14} {r['reason'][:60]}")
    assert all(p.dtype == torch.float32 for p in amp_model.parameters())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
