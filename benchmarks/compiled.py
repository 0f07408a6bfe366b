"""With the compiler on: autocast + ``torch.compile`` against O2 with ``backend="inductor"``.

Run on demand (never as a timed test):

    python benchmarks/compiled.py                          # CPU, bf16, BERT and LLaMA
    python benchmarks/compiled.py --models llama --steps 30 --repeats 2
    python benchmarks/compiled.py --modes autocast-compile,O2-inductor,autocast,O2
    python benchmarks/compiled.py --smoke                  # tiny configs: harness check

The models are HF transformers' built from configs with random weights (nothing is
downloaded), 4 layers at d=256, batch 8 x 128 tokens:

- bert: ``BertForSequenceClassification(BertConfig(hidden_size=256, num_hidden_layers=4,
  num_attention_heads=4, intermediate_size=1024))`` (vocab 30522, dropout 0.1), inputs
  ``input_ids`` and an all-ones ``attention_mask``, 2 labels;
- llama: ``LlamaForCausalLM(LlamaConfig(hidden_size=256, num_hidden_layers=4,
  num_attention_heads=4, num_key_value_heads=2, intermediate_size=688, vocab_size=32000))``,
  input ``input_ids``, next-token labels.

The modes (``--modes``), each on its own copy of the model with its own optimizer:

- ``autocast-compile``: ``torch.compile(model)`` called under ``torch.autocast("cpu",
  torch.bfloat16)``;
- ``O2-inductor``: ``ampgraph.compile(model, "O2", "bf16", backend="inductor")``;
- ``autocast``, ``O2``: the same without the compiler, for reference.

Training is a user's loop: forward, cross-entropy on the fp32 logits (``.float()``),
backward, ``torch.optim.AdamW(foreach=True)`` step, ``zero_grad``; inference is a forward
under ``torch.no_grad()`` in eval mode. Every mode runs in this one process; each timed
round steps every mode once in turn (the first mode alternates between rounds), so machine
noise hits them alike. After ``--warmup`` untimed rounds (the compilers' work), the median
of ``--steps`` rounds is reported, per ``--repeats`` measurement, with x = the
``autocast-compile`` time over each mode's (>1: faster than autocast + torch.compile).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

import ampgraph  # noqa: E402

MODELS = ("bert", "llama")
MODES = ("autocast-compile", "O2-inductor")
REFERENCE = "autocast-compile"


def build(name: str, smoke: bool) -> tuple[nn.Module, dict, Callable[[Any], torch.Tensor]]:
    """(model, inputs as keywords, loss(output)): the module docstring's configurations,
    or 1-layer d=32 ones with 2 x 16 tokens for ``--smoke``."""
    import transformers as tf

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batch, seq = (2, 16) if smoke else (8, 128)
    size = (dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=64, vocab_size=128) if smoke
            else dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4))
    if name == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(
            **size, **({} if smoke else dict(intermediate_size=1024))))
        ids = torch.randint(1, model.config.vocab_size, (batch, seq), generator=g)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        labels = torch.randint(0, model.config.num_labels, (batch,), generator=g)
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            **size, num_key_value_heads=1 if smoke else 2,
            **({} if smoke else dict(intermediate_size=688, vocab_size=32000))))
        ids = torch.randint(1, model.config.vocab_size, (batch, seq), generator=g)
        inputs = {"input_ids": ids}
        labels = ids
    else:
        raise ValueError(f"unknown model {name!r}: choose from {', '.join(MODELS)}")

    def loss(out: Any) -> torch.Tensor:
        logits = out.logits.float()
        if logits.dim() == 3:  # next-token prediction
            return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                               labels[:, 1:].flatten())
        return nn.functional.cross_entropy(logits, labels)

    return model, inputs, loss


class Mode:
    """One way of running a model: ``train_step()`` and ``infer()`` on its own copy.

    Args:
        name: one of the module docstring's modes.
        model, inputs, loss: from :func:`build`.
        backend: the compiler backend of the compiled modes (``--backend``).
        compile_mode: torch.compile's ``mode`` for both compiled modes (None: its default).
    """

    def __init__(self, name: str, model: nn.Module, inputs: dict, loss: Callable, *,
                 backend: str = "inductor", compile_mode: str | None = None):
        self.name = name
        self.model = copy.deepcopy(model)
        self.inputs = inputs
        self.loss = loss
        self.autocast = name.startswith("autocast")
        if name == "autocast-compile":
            self.net = torch.compile(self.model, backend=backend, mode=compile_mode)
        elif name == "O2-inductor":
            self.net = ampgraph.compile(self.model, "O2", "bf16", backend=backend,
                                        **_compile_options(compile_mode))
        elif name == "O2":
            self.net = ampgraph.compile(self.model, "O2", "bf16")
        elif name == "autocast":
            self.net = self.model
        else:
            raise ValueError(f"unknown mode {name!r}: choose from autocast-compile, "
                             "O2-inductor, autocast, O2")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, foreach=True)

    def forward(self) -> Any:
        if self.autocast:
            with torch.autocast("cpu", torch.bfloat16):
                return self.net(**self.inputs)
        return self.net(**self.inputs)

    def train_step(self) -> None:
        self.model.train()
        loss = self.loss(self.forward())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def infer(self) -> None:
        self.model.eval()
        with torch.no_grad():
            self.forward()


def _compile_options(compile_mode: str | None) -> dict:
    """ampgraph.compile's keyword for torch.compile's ``mode``: none without one (so the
    harness runs on checkouts from before ``compile_options``, as ``code_ab.py`` does)."""
    return {"compile_options": {"mode": compile_mode}} if compile_mode else {}


def time_interleaved(modes: list[Mode], what: str, steps: int, warmup: int) -> dict:
    """Median, min and max ms of ``what`` ("train" or "infer") per mode, one call of each
    mode in turn per round, the first mode alternating between rounds."""
    times: dict[str, list[float]] = {m.name: [] for m in modes}
    for i in range(steps + warmup):
        for m in (modes if i % 2 == 0 else modes[::-1]):
            fn = m.train_step if what == "train" else m.infer
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                times[m.name].append(1000 * (time.perf_counter() - t0))
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
            for k, v in times.items()}


def measure(name: str, args: argparse.Namespace) -> dict:
    """One model: every mode built, compiled (the warm-up), then timed ``--repeats`` times."""
    model, inputs, loss = build(name, args.smoke)
    modes = [Mode(m, model, inputs, loss, backend=args.backend,
                  compile_mode=args.compile_mode) for m in args.modes.split(",")]
    entry: dict[str, Any] = {"repeats": []}
    t0 = time.perf_counter()
    time_interleaved(modes, "train", 1, args.warmup)
    time_interleaved(modes, "infer", 1, args.warmup)
    entry["warmup_s"] = round(time.perf_counter() - t0, 1)
    for _ in range(args.repeats):
        entry["repeats"].append({what: time_interleaved(modes, what, args.steps, 0)
                                 for what in ("train", "infer")})
    return entry


def ratio(entry: dict, what: str, mode: str) -> list[float]:
    """x = the reference mode's median over ``mode``'s, one per repeat."""
    return [r[what][REFERENCE]["median_ms"] / r[what][mode]["median_ms"]
            for r in entry["repeats"]]


def print_table(name: str, entry: dict, modes: list[str]) -> None:
    print(f"\n{name}: median ms per repeat; x = {REFERENCE} / mode (>1: faster); "
          f"warm-up {entry['warmup_s']} s")
    print(f"{'mode':18}{'train ms':>22}{'x':>14}{'infer ms':>22}{'x':>14}")
    for m in modes:
        cells = []
        for what in ("train", "infer"):
            ms = " ".join(f"{r[what][m]['median_ms']:.1f}" for r in entry["repeats"])
            xs = " ".join(f"{x:.2f}" for x in ratio(entry, what, m))
            cells.append(f"{ms:>22}{xs:>14}")
        print(f"{m:18}" + "".join(cells))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="autocast + torch.compile against O2 + inductor")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES),
                   help="comma-separated: autocast-compile (first: the reference), "
                        "O2-inductor, autocast, O2")
    p.add_argument("--steps", type=int, default=20, help="timed rounds per repeat")
    p.add_argument("--warmup", type=int, default=3, help="untimed rounds (compilation)")
    p.add_argument("--repeats", type=int, default=2, help="measurements per model")
    p.add_argument("--backend", default="inductor",
                   help="torch.compile backend of both compiled modes")
    p.add_argument("--compile-mode", default=None,
                   help='torch.compile\'s mode for both compiled modes ("max-autotune", ...)')
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--smoke", action="store_true",
                   help="tiny configs, 1 step, backend aot_eager (no C++ compiler runs)")
    p.add_argument("--json", default="bench_results/compiled.json")
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    if modes[0] != REFERENCE:
        p.error(f"--modes must start with the reference, {REFERENCE}")
    if args.smoke:
        args.steps, args.warmup, args.repeats = 1, 1, 1
        if args.backend == "inductor":
            args.backend = "aot_eager"
    if args.threads:
        torch.set_num_threads(args.threads)
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["benchmarks/compiled.py"] + (argv or sys.argv[1:])),
        "ampgraph": os.path.dirname(os.path.dirname(ampgraph.__file__)),
        "backend": args.backend, "compile_mode": args.compile_mode, "models": {},
    }
    for name in args.models.split(","):
        entry = measure(name, args)
        results["models"][name] = entry
        print_table(name, entry, modes)
    ratios = {m: [x for e in results["models"].values() for w in ("train", "infer")
                  for x in ratio(e, w, m)] for m in modes[1:]}
    results["geomean"] = {m: math.exp(sum(map(math.log, xs)) / len(xs))
                          for m, xs in ratios.items()}
    for m, g in results["geomean"].items():
        print(f"geometric mean x of {m}: {g:.2f}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
