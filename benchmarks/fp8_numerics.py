"""FP8 numerics on real data every machine has: a byte-level language model trained on the
Python standard library's own source, in fp32, ampgraph O2 bf16 and O2 bf16 with FP8
products (issue 39, item 5).

The data: the ``.py`` files directly in ``os.path.dirname(os.__file__)`` (the standard
library of the running Python), in sorted order, read as bytes (vocabulary 256). Every
``--val-every-file``-th file (the 10th, 20th, ... in that order) is held out for
validation; the rest are concatenated, separated by a NUL byte, for training. Training
batches are ``--batch`` windows of ``--seq + 1`` bytes at offsets drawn from
``torch.Generator().manual_seed(seed)``, drawn once and shared by every run; validation is
the same ``--val-batches`` batches of windows (evenly spaced over the held-out text) every
time.

The model: a pre-norm GPT (learned positions, ``--layers`` blocks of causal
``F.scaled_dot_product_attention`` over ``--heads`` heads and a 4x GELU MLP, final
LayerNorm, untied head ``Linear(d, 256)``); every width a multiple of 16, so every
activation x weight product is FP8-eligible. One initialisation (``torch.manual_seed``)
is copied into each run. Each run is the same plain loop (``AdamW(lr, betas (0.9, 0.95),
weight_decay 0.1)``, linear warm-up over the first 5% of steps, cosine decay to 10%,
gradient clipping at 1.0, next-byte cross-entropy in fp32 on fp32 logits); only the
module called differs:

- ``fp32``: the model itself, eager;
- ``bf16``: ``ampgraph.compile(model, "O2", "bf16")``;
- ``fp8``: ``ampgraph.compile(model, "O2", "bf16", fp8=ampgraph.FP8Recipe(rule="all",
  keep_first_last=True, scaling=--scaling))``: every activation x weight product in FP8
  except the graph's first (block 0's qkv) and last (the head). On the CPU the FP8 product
  is emulated (operands rounded to e4m3/e5m2 with their scales, the product of those
  values), so this measures FP8's numerics, not its speed.

Reported (and written to ``--json``): train loss every step and validation loss (the mean
over the validation batches, computed by the run's own module under ``torch.no_grad()``)
every ``--eval-every`` steps and after the last (``--plot``: the curves, and beside them
each run's validation loss relative to bf16's, in %); the final losses (the mean train loss of
the last 20 steps, the last validation loss); the issue's checks, printed as PASS/FAIL
lines: FP8's final validation loss within 1% (relative) of O2 bf16's, and both below half
of fp32's loss at step 0 (without an fp32 run: the first run's).

Per-product error of FP8 against bf16: after training, with the FP8 run's final weights,
one validation batch goes through the eager fp32 model with forward pre-hooks on every
``nn.Linear`` that ran FP8 in the compiled graph (``ampgraph.explain`` rows with precision
"fp8", by module path). Each hooked input then goes, alone, through that same Linear
(the same parameters) compiled twice: ``ampgraph.compile(linear, "O2", "bf16")`` and the
same with ``fp8=FP8Recipe(rule="all", keep_first_last=False, scaling=...)`` (one product is
both first and last, so keep_first_last would keep it 16-bit); the error is
``||y_fp8 - y_bf16|| / ||y_bf16||`` (Frobenius) on that input. This isolates the error
each FP8 product adds given identical inputs; errors carried from earlier layers are not
in it. The accumulated effect is reported beside it: the relative error of the whole
FP8-compiled model's logits against the bf16-compiled model's on the same batch, same
weights, and both modules' validation losses with those weights.

Usage:
    python benchmarks/fp8_numerics.py [--steps 400] [--modes fp32,bf16,fp8]
        [--scaling tensorwise|rowwise] [--json out.json] [--plot docs/img/fp8_numerics.png]
    python benchmarks/fp8_numerics.py --smoke   # tiny sizes: harness check
"""

from __future__ import annotations

import argparse
import copy
import glob
import json
import math
import os
import pathlib
import platform
import sys
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import ampgraph  # noqa: E402

MODES = ("fp32", "bf16", "fp8")


# -- data ------------------------------------------------------------------------------------

def stdlib_text(val_every: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, validation bytes, what was read) from the stdlib's top-level .py files."""
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    train, val = [], []
    for i, path in enumerate(files):
        with open(path, "rb") as f:
            (val if (i + 1) % val_every == 0 else train).append(f.read())
    info = {"dir": os.path.dirname(os.__file__), "files": len(files),
            "val_files": len(val), "train_bytes": sum(map(len, train)),
            "val_bytes": sum(map(len, val))}
    as_tensor = lambda parts: torch.frombuffer(bytearray(b"\0".join(parts)), dtype=torch.uint8)
    return as_tensor(train).long(), as_tensor(val).long(), info


def windows(text: torch.Tensor, starts: torch.Tensor, seq: int) -> tuple[torch.Tensor, ...]:
    idx = starts[:, None] + torch.arange(seq + 1)
    chunk = text[idx]
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


# -- model -----------------------------------------------------------------------------------

class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.reshape(shape).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class ByteGPT(nn.Module):
    """Pre-norm GPT over bytes; widths multiples of 16."""

    def __init__(self, d: int, layers: int, heads: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(256, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, 256)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * layers) if name.endswith(("proj.weight",
                                                                     "fc2.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))


# -- runs ------------------------------------------------------------------------------------

def recipe(args, keep_first_last: bool = True):
    return ampgraph.FP8Recipe(rule="all", keep_first_last=keep_first_last,
                              scaling=args.scaling)


def wrap(model: nn.Module, mode: str, args) -> nn.Module:
    if mode == "fp32":
        return model
    if mode == "bf16":
        return ampgraph.compile(model, "O2", "bf16")
    return ampgraph.compile(model, "O2", "bf16", fp8=recipe(args))


def fp8_rows(net: nn.Module) -> list[dict]:
    return [r for r in ampgraph.explain(net).nodes if r["precision"] == "fp8"]


def lr_at(step: int, args) -> float:
    warm = max(1, args.steps // 20)
    if step < warm:
        return args.lr * (step + 1) / warm
    frac = (step - warm) / max(1, args.steps - warm)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


@torch.no_grad()
def val_loss(net: nn.Module, val_batches) -> float:
    return sum(float(lm_loss(net(x), y)) for x, y in val_batches) / len(val_batches)


def train(mode: str, init: dict, data, args) -> dict:
    model = ByteGPT(args.d, args.layers, args.heads, args.seq)
    model.load_state_dict(init)
    net = wrap(model, mode, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    train_starts, text, val_batches = data
    rec = {"train_loss": [], "val_loss": [], "val_steps": []}
    t0 = time.perf_counter()
    for step in range(args.steps):
        if step % args.eval_every == 0:
            rec["val_steps"].append(step)
            rec["val_loss"].append(val_loss(net, val_batches))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = windows(text, train_starts[step], args.seq)
        loss = lm_loss(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rec["train_loss"].append(float(loss.detach()))
        if args.verbose and (step % 50 == 0 or step == args.steps - 1):
            print(f"  {mode} step {step:4d} loss {rec['train_loss'][-1]:.4f} "
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)
    rec["val_steps"].append(args.steps)
    rec["val_loss"].append(val_loss(net, val_batches))
    rec["seconds"] = time.perf_counter() - t0
    rec["final_train_loss"] = sum(rec["train_loss"][-20:]) / len(rec["train_loss"][-20:])
    rec["final_val_loss"] = rec["val_loss"][-1]
    if mode == "fp8":
        rows = fp8_rows(net)
        rec["fp8_products"] = len(rows)
        rec["fp8_modules"] = sorted({r["module"] for r in rows})
    return rec, model


# -- per-product error -----------------------------------------------------------------------

def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@torch.no_grad()
def product_errors(model: nn.Module, fp8_modules: list[str], batch, val_batches, args) -> dict:
    """Each FP8 product alone (bf16 vs FP8 on the same hooked input), and the whole model."""
    x, _ = batch
    inputs, hooks = {}, []
    linears = dict(model.named_modules())
    for name in fp8_modules:
        mod = linears.get(name)
        if isinstance(mod, nn.Linear):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, a, name=name: inputs.__setitem__(name, a[0].detach().clone())))
    model(x)
    for h in hooks:
        h.remove()
    per_layer = {}
    for name, inp in inputs.items():
        lin = copy.deepcopy(linears[name])
        lo = ampgraph.compile(lin, "O2", "bf16")
        f8 = ampgraph.compile(lin, "O2", "bf16", fp8=recipe(args, keep_first_last=False))
        y_lo, y_f8 = lo(inp), f8(inp)
        ran_fp8 = bool(fp8_rows(f8))
        per_layer[name] = {"rel_err": rel(y_f8, y_lo) if ran_fp8 else None,
                           "shape": list(lin.weight.shape), "ran_fp8": ran_fp8}
    unmatched = sorted(set(fp8_modules) - set(inputs))
    lo_net = ampgraph.compile(model, "O2", "bf16")
    f8_net = ampgraph.compile(model, "O2", "bf16", fp8=recipe(args))
    errs = [v["rel_err"] for v in per_layer.values() if v["rel_err"] is not None]
    return {"per_layer": per_layer, "unmatched_fp8_modules": unmatched,
            "rel_err_min": min(errs, default=None), "rel_err_max": max(errs, default=None),
            "rel_err_median": sorted(errs)[len(errs) // 2] if errs else None,
            "logits_rel_err": rel(f8_net(x), lo_net(x)),
            "val_loss_bf16_module": val_loss(lo_net, val_batches),
            "val_loss_fp8_module": val_loss(f8_net, val_batches)}


# -- report ----------------------------------------------------------------------------------

def checks(runs: dict) -> list[tuple[str, bool, str]]:
    out = []
    ref = "fp32" if "fp32" in runs else next(iter(runs))  # one init: the same step-0 loss
    start = runs[ref]["val_loss"][0]
    for mode in ("bf16", "fp8"):
        if mode in runs:
            v = runs[mode]["final_val_loss"]
            out.append((f"{mode} final val loss well below {ref}'s initial", v < 0.5 * start,
                        f"{v:.4f} < 0.5 x {start:.4f}"))
    if "bf16" in runs and "fp8" in runs:
        a, b = runs["fp8"]["final_val_loss"], runs["bf16"]["final_val_loss"]
        r = abs(a - b) / b
        out.append(("fp8 final val loss within 1% of bf16's", r <= 0.01,
                    f"|{a:.4f} - {b:.4f}| / {b:.4f} = {100 * r:.2f}%"))
    return out


def plot(runs: dict, path: pathlib.Path, title: str) -> bool:
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, dx) = plt.subplots(1, 2, figsize=(11, 3.8))
    colors = {"fp32": "tab:blue", "bf16": "tab:orange", "fp8": "tab:green"}
    ref = "bf16" if "bf16" in runs else next(iter(runs))
    for mode, rec in runs.items():
        ax.plot(rec["train_loss"], color=colors[mode], alpha=0.35, lw=0.8)
        ax.plot(rec["val_steps"], rec["val_loss"], color=colors[mode], marker="o", ms=3,
                label=f"{mode} (val {rec['final_val_loss']:.3f})")
        gap = [100 * (a - b) / b for a, b in zip(rec["val_loss"], runs[ref]["val_loss"])]
        dx.plot(rec["val_steps"], gap, color=colors[mode], marker="o", ms=3, label=mode)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/byte)")
    ax.set_ylim(top=min(6.0, ax.get_ylim()[1]))
    ax.set_title("faint: train loss per step; dots: validation", fontsize=9)
    ax.legend()
    dx.axhline(1, color="grey", ls=":", lw=0.8)
    dx.axhline(-1, color="grey", ls=":", lw=0.8)
    dx.set_xlabel("step")
    dx.set_ylabel(f"validation loss vs {ref}'s (%)")
    dx.set_title(f"(val - {ref} val) / {ref} val; dotted: +-1%", fontsize=9)
    dx.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=80)
    return True


def add_run_arguments(ap: argparse.ArgumentParser, eval_every: int = 25) -> None:
    """The run's sizes, schedule, data and seed (``benchmarks/lean_parity.py`` takes them
    too), and ``--smoke`` (:func:`run_data` applies it)."""
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--eval-every", type=int, default=eval_every)
    ap.add_argument("--val-batches", type=int, default=4)
    ap.add_argument("--val-every-file", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes: a harness check")


def run_data(args: argparse.Namespace) -> tuple:
    """``--smoke``'s sizes applied, then ``(text, val_text, info, train_starts,
    val_batches, init)``: the text, the training windows' offsets per step, the
    validation batches and the model's initial state dict, all from ``args.seed``."""
    if args.smoke:
        args.steps, args.batch, args.seq, args.d = 4, 2, 32, 32
        args.layers, args.heads, args.eval_every, args.val_batches = 1, 2, 2, 1
    text, val_text, info = stdlib_text(args.val_every_file)
    g = torch.Generator().manual_seed(args.seed)
    train_starts = torch.randint(0, len(text) - args.seq - 1, (args.steps, args.batch),
                                 generator=g)
    n_val = args.val_batches * args.batch
    val_starts = torch.linspace(0, len(val_text) - args.seq - 2, n_val).long()
    val_batches = [windows(val_text, s, args.seq) for s in val_starts.split(args.batch)]
    torch.manual_seed(args.seed)
    init = copy.deepcopy(ByteGPT(args.d, args.layers, args.heads, args.seq).state_dict())
    return text, val_text, info, train_starts, val_batches, init


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default=",".join(MODES), help="comma list of fp32,bf16,fp8")
    ap.add_argument("--scaling", choices=("tensorwise", "rowwise"), default="tensorwise")
    add_run_arguments(ap)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--json", type=pathlib.Path)
    ap.add_argument("--plot", type=pathlib.Path, help="PNG of the loss curves")
    args = ap.parse_args(argv)
    text, val_text, info, train_starts, val_batches, init = run_data(args)
    modes = [m for m in args.modes.split(",") if m]
    if bad := set(modes) - set(MODES):
        ap.error(f"--modes: unknown {sorted(bad)}; choose from {MODES}")
    if any(d % 16 for d in (args.d, args.d // args.heads)) and "fp8" in modes:
        ap.error("--d and --d / --heads must be multiples of 16 for FP8")
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")

    n_params = sum(v.numel() for v in init.values())
    print(f"data: {info['files']} files of {info['dir']} ({info['train_bytes']} train bytes, "
          f"{info['val_files']} files / {info['val_bytes']} bytes held out); model "
          f"d={args.d} x{args.layers} heads {args.heads}, {n_params / 1e6:.2f} M params; "
          f"{args.steps} steps of {args.batch} x {args.seq}; threads {torch.get_num_threads()}",
          flush=True)

    runs, final_fp8 = {}, None
    for mode in modes:
        rec, model = train(mode, init, (train_starts, text, val_batches), args)
        runs[mode] = rec
        extra = f", {rec['fp8_products']} FP8 products" if mode == "fp8" else ""
        print(f"{mode:5s} final train {rec['final_train_loss']:.4f}  val "
              f"{rec['final_val_loss']:.4f}  (start val {rec['val_loss'][0]:.4f}; "
              f"{rec['seconds']:.0f} s{extra})", flush=True)
        if mode == "fp8":
            final_fp8 = model
    if final_fp8 is not None and not runs["fp8"]["fp8_products"]:
        print("WARNING: the fp8 run's graph has no FP8 products (explain rows)")
    res = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
           "data": info, "params": n_params, "runs": runs,
           "machine": {"platform": platform.platform(), "processor": platform.processor(),
                       "torch": torch.__version__, "python": platform.python_version(),
                       "threads": torch.get_num_threads()},
           "date": time.strftime("%Y-%m-%d")}
    ok = True
    res["checks"] = []
    for name, passed, detail in checks(runs):
        ok &= passed
        res["checks"].append({"check": name, "pass": passed, "detail": detail})
        print(f"{'PASS' if passed else 'FAIL'}: {name}: {detail}")
    if final_fp8 is not None and runs["fp8"]["fp8_products"]:
        err = product_errors(final_fp8, runs["fp8"]["fp8_modules"], val_batches[0],
                             val_batches, args)
        res["fp8_vs_bf16"] = err
        print("per-product relative error, FP8 vs bf16 (same input, same weights):")
        for name, v in err["per_layer"].items():
            e = "not FP8 alone" if v["rel_err"] is None else f"{v['rel_err']:.4f}"
            print(f"  {name:20s} {str(tuple(v['shape'])):12s} {e}")
        if err["rel_err_max"] is not None:
            print(f"  min {err['rel_err_min']:.4f}  median {err['rel_err_median']:.4f}  "
                  f"max {err['rel_err_max']:.4f}")
        print(f"whole model, FP8 vs bf16 module: logits rel err {err['logits_rel_err']:.4f}; "
              f"val loss {err['val_loss_fp8_module']:.4f} vs {err['val_loss_bf16_module']:.4f}")
    if args.plot:
        title = (f"byte GPT d={args.d} x{args.layers} on the Python stdlib, "
                 f"{args.steps} steps; fp8: {args.scaling}, rule all, first/last bf16")
        res["plot"] = str(args.plot) if plot(runs, args.plot, title) else None
    if args.json:
        args.json.write_text(json.dumps(res, indent=1, default=str))
    return 0 if ok or args.smoke else 1


if __name__ == "__main__":
    sys.exit(main())
