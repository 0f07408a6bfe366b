"""Numerics stories on CPU: (a) loss scaling through an overflow burst, (b) 16-bit weights.

(a) A CLIP-style dual encoder (image MLP on digits, text encoder over class-name tokens,
contrastive loss with a learnable temperature) trained at O2-fp16. After ``--burst-at`` steps
``--burst`` corrupt batches (pixels x 1e6: the forward overflows at any scale) arrive. For
DynamicLossScaleManager with GradScaler's defaults and AdaptiveLossScaleManager without and
with per_layer: loss scale per step, per-layer fraction of underflowed gradient elements
(non-zero with |g| * scale < 2**-14), skipped steps, steps to recover (< 1% underflow in every
layer after the burst), and the loss gap to an fp32 run on the same batches.

(b) 16-bit weights: digits MLP (SGD momentum) and a tiny transformer (AdamW) with fp32
masters, plain bf16, Kahan, stochastic rounding and modified momentum SGD: test accuracy,
bytes of params (+ working copies) + grads + optimizer state per parameter, swamped updates.

Usage: python benchmarks/numerics.py [--quick] [--json out.json] [--plots docs/img]
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ampgraph  # noqa: E402
from ampgraph.train.low_precision_weights import ModifiedMomentumSGD, state_bytes  # noqa: E402

TINY = 2.0**-14


def digits():
    from sklearn import datasets, model_selection

    x, y = datasets.load_digits(return_X_y=True)
    xtr, xte, ytr, yte = model_selection.train_test_split(x, y, test_size=0.2, random_state=0,
                                                          stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32) / 16
    return f(xtr), torch.tensor(ytr), f(xte), torch.tensor(yte)


# -- (a) loss scaling ------------------------------------------------------------------------

class DualEncoder(nn.Module):
    """Image tower (MLP) and text tower (token embedding, mean, projection); CLIP loss."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, dim))
        self.text_embed = nn.Embedding(20, 32)
        self.text_proj = nn.Linear(32, dim)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, pixels, tokens):
        img = F.normalize(self.image(pixels), dim=-1)
        txt = F.normalize(self.text_proj(self.text_embed(tokens).mean(1)), dim=-1)
        return self.logit_scale.exp() * img @ txt.t()


def clip_loss(logits, labels):
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


def caption(y):  # "a photo of the digit <d>": 4 fixed tokens + the digit's token
    return torch.stack([torch.full_like(y, 10), torch.full_like(y, 11),
                        torch.full_like(y, 12), y + 13 - 3 * (y > 6).long()], 1)


def unique_batches(xtr, ytr, n, batch):
    g = torch.Generator().manual_seed(1)
    out = []
    while len(out) < n:
        perm = torch.randperm(len(xtr), generator=g)
        for i in range(0, len(perm) - batch + 1, batch):
            idx = perm[i:i + batch]
            # one image per class so the contrastive targets are unambiguous
            keep = idx[torch.tensor([int((ytr[idx][:j] == ytr[idx][j]).sum()) == 0
                                     for j in range(len(idx))])]
            out.append((xtr[keep], caption(ytr[keep]), torch.arange(len(keep))))
            if len(out) == n:
                break
    return out


def layer_underflow(model, scales):
    out = {}
    for name, mod in model.named_modules():
        ps = [p for p in mod.parameters(recurse=False) if p.grad is not None]
        if name and ps:
            s = scales.get(name, scales[""])
            g = torch.cat([p.grad.reshape(-1) for p in ps]).abs()
            nz = g != 0
            out[name] = float((nz & (g * s < TINY)).sum() / nz.sum().clamp_min(1))
    return out


def run_scaling(kind, batches, burst_at, burst, fp32=False):
    torch.manual_seed(0)
    model = DualEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    manager = {"dynamic": lambda: ampgraph.DynamicLossScaleManager(2.0**16, 2, 2000),
               "adaptive": lambda: ampgraph.AdaptiveLossScaleManager(),
               "adaptive per_layer": lambda: ampgraph.AdaptiveLossScaleManager(per_layer=True),
               }.get(kind, lambda: None)()
    step = ampgraph.build_train_step(model, clip_loss, opt, "O0" if fp32 else "O2",
                                     "auto" if fp32 else "fp16", loss_scale_manager=manager)
    rec = {"scale": [], "loss": [], "skipped": 0, "underflow": []}
    for i, (px, tok, lab) in enumerate(batches):
        if burst_at <= i < burst_at + burst:
            px = px * 1e6
        out = step(px, tok, lab)
        rec["loss"].append(float(out.loss) if not out.overflow else float("nan"))
        rec["scale"].append(out.loss_scale)
        rec["skipped"] += int(out.overflow)
        if not out.overflow and not fp32:
            scales = {"": out.loss_scale}
            if manager is not None and getattr(manager, "per_layer", False):
                scales.update(manager.layer_scales)
            rec["underflow"].append(layer_underflow(model, scales))
        else:
            rec["underflow"].append(None)
    after = [(i, u) for i, u in enumerate(rec["underflow"]) if i >= burst_at + burst and u]
    # steps after the burst until every layer stays below 1% underflow for the rest of the run
    bad = [i for i, u in after if max(u.values()) >= 0.01]
    rec["steps_to_recover"] = (None if bad and bad[-1] >= len(batches) - 5
                               else (bad[-1] + 1 if bad else burst_at + burst) - burst_at - burst)
    return rec


def story_a(args):
    xtr, ytr, _, _ = digits()
    batches = unique_batches(xtr, ytr, args.steps, 32)
    ref = run_scaling("fp32", batches, args.burst_at, args.burst, fp32=True)
    res = {}
    for kind in ("dynamic", "adaptive", "adaptive per_layer"):
        t = time.perf_counter()
        rec = run_scaling(kind, batches, args.burst_at, args.burst)
        tail = slice(-20, None)
        clean = [a - b for a, b in zip(rec["loss"][tail], ref["loss"][tail])]
        rec["loss_gap_last20"] = sum(clean) / len(clean)
        rec["seconds"] = time.perf_counter() - t
        res[kind] = rec
        last = rec["underflow"][-1] or {}
        print(f"{kind:20s} skipped {rec['skipped']:3d}  recover {rec['steps_to_recover']}  "
              f"final scale {rec['scale'][-1]:.3g}  max layer underflow "
              f"{max(last.values(), default=0):.3f}  loss gap {rec['loss_gap_last20']:+.4f}")
    res["fp32_loss_last20"] = sum(ref["loss"][-20:]) / 20
    return res


# -- (b) 16-bit weights ----------------------------------------------------------------------

class TinyTransformer(nn.Module):
    """Sequence of 8 tokens in [0, 16): predict the largest token (16 classes)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 32)
        self.block = nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 16)

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)).mean(1))


def seq_data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 16, (n, 8), generator=g)
    return x, x.max(1).values


def run_weights(task, mode, epochs, optimizer="default"):
    torch.manual_seed(0)
    if task == "digits":
        xtr, ytr, xte, yte = digits()
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        make = lambda ps: torch.optim.SGD(ps, lr=0.003, momentum=0.9)
    else:
        (xtr, ytr), (xte, yte) = seq_data(2048, 0), seq_data(512, 1)
        model = TinyTransformer()
        make = lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01)
    if optimizer == "modified":
        make = lambda ps: ModifiedMomentumSGD(ps, lr=0.003 if task == "digits" else 0.01,
                                              momentum=0.9)
    opt = make(model.parameters())
    step = ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16",
                                     master_weights=mode)
    if step.weight_update is not None:
        step.weight_update.track_swamping = True
    order = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        perm = torch.randperm(len(xtr), generator=order)
        for i in range(0, len(perm) - 31, 32):
            step(xtr[perm[i:i + 32]], ytr[perm[i:i + 32]])
    model.eval()
    with torch.no_grad():
        acc = float((step.module(xte).argmax(1) == yte).float().mean()) * 100
    copies = step.module.working_copies()
    upd = step.weight_update
    b = state_bytes(model, opt, copies)
    numel = sum(p.numel() for p in model.parameters())
    return {"acc": acc, "bytes_per_param": b["per_param"],
            "bytes_per_param_without_working_copies": (b["total"] - b["working_copies"]) / numel,
            "swamped": (upd.swamped / upd.updated) if upd and upd.updated else None}


def story_b(args):
    res = {}
    for task, epochs in (("digits", args.epochs), ("transformer", max(1, args.epochs // 4))):
        res[task] = {}
        for label, mode, opt in (("fp32 masters", "fp32", "default"),
                                 ("plain bf16", "none", "default"),
                                 ("kahan", "kahan", "default"),
                                 ("stochastic", "stochastic", "default"),
                                 ("modified momentum SGD (bf16)", "none", "modified")):
            r = run_weights(task, mode, epochs, opt)
            res[task][label] = r
            sw = "-" if r["swamped"] is None else f"{r['swamped']:.2f}"
            print(f"{task:12s} {label:30s} acc {r['acc']:6.2f}  bytes/param "
                  f"{r['bytes_per_param']:5.2f} ({r['bytes_per_param_without_working_copies']:.2f}"
                  f" w/o working copies)  unchanged-after-update {sw}")
    return res


def plot(res, folder):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    kinds = ("dynamic", "adaptive", "adaptive per_layer")
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for kind in kinds:
        ax.semilogy(res[kind]["scale"], label=kind)
    ax.set_xlabel("step")
    ax.set_ylabel("loss scale")
    ax.set_title("Loss scale through an overflow burst (CLIP-style dual encoder, fp16)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "numerics_loss_scale.png", dpi=100)
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5), sharey=True)
    for ax, kind in zip(axes, kinds):
        rows = res[kind]["underflow"]
        names = sorted({k for r in rows if r for k in r})
        for name in names:
            ax.plot([r[name] if r else float("nan") for r in rows], label=name)
        ax.set_title(kind)
        ax.set_xlabel("step")
    axes[0].set_ylabel("underflowed fraction of gradient elements")
    axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(folder / "numerics_underflow.png", dpi=100)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="few steps (smoke test)")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--plots", type=pathlib.Path, help="folder for the PNG plots")
    args = ap.parse_args(argv)
    args.steps, args.burst_at, args.burst, args.epochs = (
        (40, 10, 8, 2) if args.quick else (200, 60, 20, 20))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="fp16 on a CPU")
    res = {"loss_scaling": story_a(args), "weights": story_b(args),
           "config": {k: getattr(args, k) for k in ("steps", "burst_at", "burst", "epochs")}}
    if args.plots:
        plot(res["loss_scaling"], args.plots)
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
