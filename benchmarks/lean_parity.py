"""Loss parity of the lean step's tiers (issue 46, item 6): the byte-level GPT of
``benchmarks/fp8_numerics.py`` trained on the standard library's own source, 400 steps,
with ``ampgraph.build_train_step`` in each memory tier, against O2 with fp32 masters and
the head and loss apart.

The data, the model, its initialisation, the batches and the learning-rate schedule are
``fp8_numerics.py``'s (read there), with two differences: the loss is part of the model
(``WithLoss``: next-byte cross-entropy on fp32 logits), so it is in the captured graph
where the head-and-loss fusion finds it; and there is no gradient clipping, which
``release_grads`` refuses (every tier runs without it, the reference too). AdamW(lr,
betas (0.9, 0.95), weight decay 0.1) for every tier:

- ``unfused``: fp32 masters, ``head_loss="off"`` (the reference);
- ``fused``: fp32 masters, the head and loss fused (the default step);
- ``lean``: ``fused`` with ``release_grads=True``;
- ``stochastic``: bf16 weights and optimizer state, stochastic rounding
  (``master_weights="stochastic"``);
- ``leanest``: ``stochastic`` with ``release_grads=True``.

Validation loss (the mean over the validation batches, the tier's own module in eval mode
under ``torch.no_grad()``) every ``--eval-every`` steps and after the last. Checks, as
PASS/FAIL lines: ``fused``'s final validation loss within 0.3% of ``unfused``'s, every
other tier's within 1%.

``--fp32-products``: the 16-bit products computed in fp32 into their 16-bit results
(``benchmarks/memory.py``'s ``Fp32Products``), for a CPU without bf16 instructions: the
same inputs, an fp32 accumulation rounded once, as the 16-bit kernels (in another
summation order).

Usage:
    python benchmarks/lean_parity.py [--steps 400] [--tiers unfused,fused,lean,...]
        [--json out.json] [--fp32-products]
    python benchmarks/lean_parity.py --smoke
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import fp8_numerics as base  # noqa: E402 - benchmarks/, the script's folder
from memory import Fp32Products  # noqa: E402

import ampgraph  # noqa: E402

TIERS = {
    "unfused": {"head_loss": "off"},
    "fused": {},
    "lean": {"memory": "lean"},  # release_grads=True
    "stochastic": {"master_weights": "stochastic"},
    "leanest": {"memory": "leanest"},  # release_grads=True, master_weights="stochastic"
}
BOUNDS = {"fused": 0.003}  # relative to unfused's final validation loss; others 1%


class WithLoss(nn.Module):
    """The model and its next-byte cross-entropy, as one module returning the loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))


def train(tier: str, init: dict, data, args) -> dict:
    model = base.ByteGPT(args.d, args.layers, args.heads, args.seq)
    model.load_state_dict(init)
    wrapped = WithLoss(model)
    opt = torch.optim.AdamW(wrapped.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    step = ampgraph.build_train_step(wrapped, None, opt, "O2", "bf16", **TIERS[tier])
    net = step.module
    train_starts, text, val_batches = data
    rec = {"train_loss": [], "val_loss": [], "val_steps": []}

    def evaluate() -> None:
        net.eval()
        with torch.no_grad():
            rec["val_loss"].append(sum(float(net(x, y)) for x, y in val_batches)
                                   / len(val_batches))
        net.train()

    t0 = time.perf_counter()
    for i in range(args.steps):
        if i % args.eval_every == 0:
            rec["val_steps"].append(i)
            evaluate()
        for group in opt.param_groups:
            group["lr"] = base.lr_at(i, args)
        x, y = base.windows(text, train_starts[i], args.seq)
        rec["train_loss"].append(float(step(x, y).loss))
    rec["val_steps"].append(args.steps)
    evaluate()
    rec["seconds"] = time.perf_counter() - t0
    rec["final_val_loss"] = rec["val_loss"][-1]
    rec["fused"] = any("fused with the head's product" in r["reason"]
                       for r in ampgraph.explain(net).nodes)
    return rec


def checks(runs: dict) -> list[tuple[str, bool, str]]:
    if "unfused" not in runs:
        return []
    ref = runs["unfused"]["final_val_loss"]
    out = []
    for tier, rec in runs.items():
        if tier == "unfused":
            continue
        bound = BOUNDS.get(tier, 0.01)
        diff = rec["final_val_loss"] / ref - 1
        out.append((f"{tier}: final validation loss within {bound:.1%} of unfused O2's",
                    abs(diff) <= bound, f"{rec['final_val_loss']:.4f} vs {ref:.4f} "
                    f"({diff:+.2%})"))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiers", default=",".join(TIERS))
    base.add_run_arguments(ap, eval_every=50)
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--fp32-products", action="store_true",
                    help="16-bit products computed in fp32 (a CPU without bf16)")
    args = ap.parse_args(argv)
    text, _, info, train_starts, val_batches, init = base.run_data(args)
    runs = {}
    for tier in args.tiers.split(","):
        with Fp32Products() if args.fp32_products else contextlib.nullcontext():
            runs[tier] = train(tier, init, (train_starts, text, val_batches), args)
        rec = runs[tier]
        print(f"{tier:<11} final val {rec['final_val_loss']:.4f}  last train "
              f"{rec['train_loss'][-1]:.4f}  fused head {rec['fused']}  "
              f"{rec['seconds']:.0f} s", flush=True)
    results = checks(runs)
    for what, ok, detail in results:
        print(f"{'PASS' if ok else 'FAIL'}: {what}: {detail}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "data": info, "runs": runs,
                                         "checks": results, "torch": torch.__version__},
                                        indent=1, default=str))
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
