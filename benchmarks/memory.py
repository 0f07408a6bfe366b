"""Memory of a whole training step, to the byte: fixed + transient = total, per mode (issue 46).

Each (model, mode) runs in a fresh process of its own, under the profiler's allocation
events (``torch.profiler.profile(profile_memory=True)``) started before the model is built,
so every tensor the process makes is counted: parameters, optimizer state, gradients, and
whatever ampgraph keeps between steps (working copies, gradient buffers). The process runs
``--warmup`` steps, then ``--steps`` measured ones:

- **fixed**: the bytes live when the measured steps start (parameters, optimizer state,
  kept buffers; the gradients are released by every loop below before that point, so a
  gradient still live there is one a mode keeps);
- **total**: the peak of live bytes during the measured steps;
- **transient**: total minus fixed.

Bytes are exact on any machine: they are the bytes the same step holds on a GPU, up to
its allocator's rounding (a CPU tensor's bytes are its storage's).

Models (built from configs, random weights, nothing downloaded; each takes ``labels``, so
the loss is the model's own, inside the captured graph):

- ``llama32k`` / ``llama128k``: HF ``LlamaForCausalLM``, d=512, 4 layers, 8 heads,
  intermediate 1376, vocabulary 32000 / 128256 (untied), 2 x 512 tokens;
- ``gpt2``: HF ``GPT2LMHeadModel(GPT2Config())`` (GPT-2 small, tied embeddings), 4 x 128;
- ``bert``: HF ``BertForMaskedLM(BertConfig())`` (BERT-base, tied decoder), 8 x 128, 15% of
  the tokens labelled, the rest ``-100``;
- ``tiny``: a 1-layer LLaMA, d=32, vocabulary 300, 2 x 16 (``--smoke``: the harness check);
- ``small``: a 2-layer LLaMA, d=128, vocabulary 8000, 2 x 256 (the ``--fp32-products``
  check: its real 16-bit products take seconds even where they run at 0.2 GFLOP/s).

Dropout is 0 for every model, so the modes compute the same step.

Modes (``torch.optim.AdamW(lr=1e-4)``, its default CPU implementation, in all of them;
``--fused-adamw``: ``fused=True`` in all of them, whose step makes no temporaries the
size of a parameter):

- ``autocast``: the fp32 model under ``torch.autocast("cpu", torch.bfloat16)``, the user's
  loop (``loss.backward(); opt.step(); opt.zero_grad()``);
- ``floor``: ``model.to(torch.bfloat16)``, the same loop without autocast: all-bf16
  training, no fp32 masters (the floor a mixed-precision step measures itself against);
- ``o2``: ``ampgraph.compile(model, "O2", "bf16")`` and the user's loop;
- ``step-unfused``: ``ampgraph.build_train_step(model, None, opt, "O2", "bf16",
  head_loss="off")``, fp32 masters, the head and the loss apart (the step before issue 46);
- ``step``: ``ampgraph.build_train_step(model, None, opt, "O2", "bf16")``, fp32 masters,
  the head and its loss fused (the step reads only the loss: ``head_loss``);
- ``step-stochastic``: the same with ``master_weights="stochastic"`` (bf16 weights,
  stochastic-rounding updates, bf16 optimizer state);
- ``step-lean``: ``memory="lean"``, ``step`` with ``release_grads=True`` (each parameter
  stepped in backward, its gradient freed there);
- ``step-leanest``: ``memory="leanest"``, ``step-stochastic`` with ``release_grads=True``.

``--fp32-products``: on a CPU without bf16 instructions (AVX2: oneDNN's reference kernel
runs a bf16 product at ~0.2 GFLOP/s), every 16-bit product (``mm``, ``addmm``, ``bmm``,
their ``out=`` forms) is computed in fp32 by blocks of at most 1 MiB per operand and
written into the 16-bit result the real op would make (:class:`Fp32Products`): the
allocations are the real step's plus at most three live 1 MiB blocks; the values are the
fp32-accumulated products, rounded once, as the 16-bit kernels compute them (in another
summation order). A mode whose attention is aten's own fused kernel (autocast, the floor)
still runs its 16-bit products there.

Run::

    python benchmarks/memory.py                                   # every model and mode
    python benchmarks/memory.py --models llama32k --modes autocast,step --json mem.json
    python benchmarks/memory.py --report mem.json --plot docs/img/memory.png
    python benchmarks/memory.py --smoke                           # tiny: the harness check
    python benchmarks/memory.py --fp32-products ...               # a CPU without bf16

Prints one row per (model, mode) with the ratio of its total to autocast's, and the bytes
per parameter, fixed and total; ``--json`` writes the rows, ``--plot`` the bars (fixed and
transient stacked, per mode, one panel per model).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MIB = 1 << 20
MODELS = ("llama32k", "llama128k", "gpt2", "bert")
MODES = ("autocast", "floor", "o2", "step-unfused", "step", "step-stochastic", "step-lean",
         "step-leanest")
STEPS = {  # build_train_step's arguments per mode
    "step-unfused": {"head_loss": "off"}, "step": {},
    "step-stochastic": {"master_weights": "stochastic"},
    "step-lean": {"memory": "lean"},  # release_grads=True
    "step-leanest": {"memory": "leanest"},  # and master_weights="stochastic"
}


class Fp32Products(TorchDispatchMode):
    """16-bit ``mm``/``addmm``/``bmm`` (and their ``out=`` forms) computed in fp32, by
    blocks of at most ``BLOCK`` elements per operand, into the 16-bit result the op would
    allocate (``--fp32-products``, see the module docstring)."""

    BLOCK = 1 << 18  # fp32 elements: 1 MiB

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet not in (aten.mm, aten.addmm, aten.bmm):
            return func(*args, **kwargs)
        bias, (a, b) = (args[0], args[1:3]) if packet is aten.addmm else (None, args[:2])
        if a.dtype not in (torch.bfloat16, torch.float16) or kwargs.get("beta", 1) != 1 \
                or kwargs.get("alpha", 1) != 1:
            return func(*args, **kwargs)
        out = kwargs.get("out")
        if out is None:
            out = torch.empty((*a.shape[:-1], b.shape[-1]), dtype=a.dtype, device=a.device)
        lead = a.shape[0] if a.dim() == 3 else 1
        k, m, n = a.shape[-1], a.shape[-2], b.shape[-1]
        rows = max(1, self.BLOCK // (lead * k))
        cols = max(1, self.BLOCK // (lead * k))
        for i in range(0, m, rows):
            ai = a[..., i:i + rows, :].float()
            for j in range(0, n, cols):
                part = torch.matmul(ai, b[..., :, j:j + cols].float())
                if bias is not None:
                    part += bias[..., j:j + cols].float()
                out[..., i:i + rows, j:j + cols].copy_(part)
                del part
            del ai
        return out


def build(name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The model (fp32, seeded) and its keyword inputs, ``labels`` included."""
    import transformers as tf

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    llama = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=8, intermediate_size=1376)
    if name in ("llama32k", "llama128k", "tiny", "small"):
        if name == "tiny":
            cfg = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                       num_key_value_heads=2, intermediate_size=64, vocab_size=300)
            batch, seq = 2, 16
        elif name == "small":
            cfg = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=4, intermediate_size=344, vocab_size=8000)
            batch, seq = 2, 256
        else:
            cfg = dict(llama, vocab_size=32000 if name == "llama32k" else 128256)
            batch, seq = 2, 512
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**cfg, tie_word_embeddings=False))
    elif name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0,
                                                 attn_pdrop=0.0))
        batch, seq = 4, 128
    elif name == "bert":
        model = tf.BertForMaskedLM(tf.BertConfig(hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0))
        batch, seq = 8, 128
    else:
        raise ValueError(f"unknown model {name!r}; choose from {MODELS + ('tiny', 'small')}")
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (batch, seq), generator=g)
    labels = ids.clone()
    if name == "bert":  # masked LM: 15% of the positions carry a label
        labels[torch.rand(batch, seq, generator=g) >= 0.15] = -100
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def make_step(mode: str, model: nn.Module, fused: bool = False
              ) -> tuple[Any, torch.optim.Optimizer]:
    """``(step(inputs) -> loss, optimizer)`` for ``mode`` (see the module docstring)."""
    import ampgraph

    if mode == "floor":
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None)
    if mode in STEPS:
        train_step = ampgraph.build_train_step(model, None, opt, "O2", "bf16", **STEPS[mode])
        return (lambda inputs: train_step(**inputs).loss), opt
    if mode not in ("autocast", "floor", "o2"):
        raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")
    net = ampgraph.compile(model, "O2", "bf16") if mode == "o2" else model

    def user_step(inputs: dict) -> torch.Tensor:
        with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
            loss = net(**inputs).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return user_step, opt


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (moments, step counters)."""
    return sum(t.untyped_storage().nbytes() for state in opt.state.values()
               for t in state.values() if isinstance(t, torch.Tensor))


def measure(name: str, mode: str, warmup: int, steps: int, fused: bool = False,
            fp32_products: bool = False) -> dict:
    """One (model, mode) in this process: fixed, transient and total bytes (module docstring)."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    products = Fp32Products() if fp32_products else contextlib.nullcontext()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, products:
        model, inputs = build(name)
        n_params = sum(p.numel() for p in model.parameters())
        step, opt = make_step(mode, model, fused)
        losses = [float(step(inputs)) for _ in range(warmup)]
        t_fixed = time.time_ns()
        params = sum(p.untyped_storage().nbytes() for p in model.parameters())
        grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters()
                    if p.grad is not None)
        optimizer_state = state_bytes(opt)
        losses += [float(step(inputs)) for _ in range(steps)]
    kineto = prof.profiler.kineto_results.events()
    live, fixed, total, t_peak = 0, None, 0, t_fixed
    events = sorted((e.start_ns(), e.nbytes()) for e in kineto if e.name() == "[memory]")
    for t, n in events:
        if fixed is None and t >= t_fixed:
            fixed = total = live
        live += n
        if fixed is not None and live > total:
            total, t_peak = live, t
    fixed = live if fixed is None else fixed
    # the ops running at the peak, outermost first (which part of the step it is in)
    around = sorted((e.start_ns(), e.name()) for e in kineto if e.name() != "[memory]"
                    and e.start_ns() <= t_peak <= e.start_ns() + e.duration_ns())
    return {
        "model": name, "mode": mode, "params": n_params,
        "fixed": fixed, "transient": total - fixed, "total": total,
        "fixed_parts": {"parameters": params, "optimizer_state": optimizer_state,
                        "gradients_kept": grads,
                        "other_kept": fixed - params - optimizer_state - grads},
        "peak_in": [name for _, name in around][:6], "losses": losses, "fused_adamw": fused,
        "fp32_products": fp32_products, "torch": torch.__version__,
    }


def run_fresh(name: str, mode: str, args: argparse.Namespace) -> dict:
    """:func:`measure` in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", name, mode,
           "--warmup", str(args.warmup), "--steps", str(args.steps)] + (
               ["--fused-adamw"] if args.fused_adamw else []) + (
               ["--fp32-products"] if args.fp32_products else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"model": name, "mode": mode, "error": out.stderr.strip()[-800:]}


def table(rows: list[dict]) -> str:
    """One line per row: MiB fixed + transient = total, the ratio to autocast's total, and
    bytes per parameter."""
    base = {r["model"]: r["total"] for r in rows if r.get("mode") == "autocast" and "total" in r}
    out = [f"{'model':<10} {'mode':<16} {'fixed':>8} {'transient':>10} {'total MiB':>10} "
           f"{'vs autocast':>11} {'B/param fixed':>13} {'B/param total':>13}"]
    for r in rows:
        if "error" in r:
            out.append(f"{r['model']:<10} {r['mode']:<16} error: {r['error'][-200:]}")
            continue
        ratio = f"{r['total'] / base[r['model']]:.2f}x" if r["model"] in base else "-"
        out.append(f"{r['model']:<10} {r['mode']:<16} {r['fixed'] / MIB:8.0f} "
                   f"{r['transient'] / MIB:10.0f} {r['total'] / MIB:10.0f} {ratio:>11} "
                   f"{r['fixed'] / r['params']:13.2f} {r['total'] / r['params']:13.2f}")
    return "\n".join(out)


def markdown(rows: list[dict]) -> str:
    """The rows as a markdown table, one line per model and mode."""
    base = {r["model"]: r["total"] for r in rows if r.get("mode") == "autocast" and "total" in r}
    out = ["| model | mode | fixed + transient = total MiB | vs autocast | bytes/param "
           "(fixed, total) | peak in |", "|---|---|---|---|---|---|"]
    for r in rows:
        if "total" not in r:
            continue
        ratio = f"{r['total'] / base[r['model']]:.2f}x" if r["model"] in base else "-"
        where = next((n for n in reversed(r.get("peak_in", [])) if not n.startswith("aten::")),
                     "")
        out.append(f"| {r['model']} | {r['mode']} | {r['fixed'] / MIB:.0f} + "
                   f"{r['transient'] / MIB:.0f} = {r['total'] / MIB:.0f} | {ratio} | "
                   f"{r['fixed'] / r['params']:.1f}, {r['total'] / r['params']:.1f} | "
                   f"{where.replace('|', '/')} |")
    return "\n".join(out)


def plot(rows: list[dict], path: str) -> None:
    """Bars per mode, fixed and transient stacked, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = list(dict.fromkeys(r["model"] for r in rows if "total" in r))
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.8), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r["model"] == model and "total" in r]
        x = range(len(mine))
        fixed = [r["fixed"] / MIB for r in mine]
        transient = [r["transient"] / MIB for r in mine]
        ax.bar(x, fixed, color="#4c72b0", label="fixed")
        ax.bar(x, transient, bottom=fixed, color="#dd8452", label="transient")
        base = next((r["total"] for r in mine if r["mode"] == "autocast"), None)
        for i, r in zip(x, mine):
            label = f"{r['total'] / MIB:.0f}" + (f"\n{r['total'] / base:.2f}x" if base else "")
            ax.text(i, r["total"] / MIB, label, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(x), [r["mode"] for r in mine], rotation=35, ha="right", fontsize=8)
        ax.set_title(model, fontsize=10)
        ax.set_ylabel("MiB")
        ax.margins(y=0.18)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", help="write the rows here (JSON)")
    p.add_argument("--plot", help="write the bars here (PNG)")
    p.add_argument("--markdown", help="write the rows here (a markdown table)")
    p.add_argument("--report", nargs="+", help="read rows from these JSON files instead")
    p.add_argument("--smoke", action="store_true", help="the tiny model, 1 + 1 steps")
    p.add_argument("--fused-adamw", action="store_true",
                   help="AdamW(fused=True) in every mode (no per-parameter temporaries)")
    p.add_argument("--fp32-products", action="store_true",
                   help="16-bit products computed in fp32 by blocks (a CPU without bf16)")
    p.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(*args.worker, args.warmup, args.steps, args.fused_adamw,
                                 args.fp32_products)))
        return 0
    if args.smoke:
        args.models, args.warmup, args.steps = "tiny", 1, 1
    if args.report:
        rows = [r for f in args.report for r in json.loads(Path(f).read_text())]
    else:
        rows = []
        for name in args.models.split(","):
            for mode in args.modes.split(","):
                rows.append(run_fresh(name, mode, args))
                print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if args.plot:
        plot(rows, args.plot)
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows) + "\n")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
