"""Capture time of tiny HuggingFace models: ``ampgraph.compile(model, "O2")`` and the first call.

    python benchmarks/capture_time.py [--models swin,swinv2,donut_swin,vit,bert] [--repeat N]
                                      [--json FILE]

Each run builds the model afresh from a small config (random weights, nothing downloaded)
and times ``ampgraph.compile(model, "O2")`` plus its first no-grad call: torch.export
(``ampgraph.capture``), the AMP passes and the call itself. The capture and pass seconds of
that call are reported apart (the rest is the graph's first run); ``cos`` is the first
output's cosine to the fp32 model's.

The Swin family (Swin, Swin V2, Donut's Swin) is built at ``image_size=64, patch_size=4,
embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=2`` on a (2, 3, 64,
64) batch; ViT at 32 px (hidden 32, 2 layers, patch 8); BERT at hidden 32, 2 layers, on 2 x 12
tokens. A warm-up compile of a small linear model pays the process's one-time costs first.
``--repeat N`` reports the fastest of N runs (the least disturbed on a shared machine) with
the median.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ampgraph  # noqa: E402
from ampgraph import module as amp_module  # noqa: E402
from ampgraph.capture import cache as amp_cache  # noqa: E402

SWIN = dict(image_size=64, patch_size=4, embed_dim=16, depths=[1, 1, 1, 1],
            num_heads=[1, 1, 1, 1], window_size=2)
SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)


def build(name: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """(model in eval mode, keyword inputs) of a zoo name."""
    import transformers as tf
    g = torch.Generator().manual_seed(1)
    images = {"pixel_values": torch.randn(2, 3, 64, 64, generator=g)}
    makers: dict[str, Callable[[], tuple[torch.nn.Module, dict]]] = {
        "swin": lambda: (tf.SwinModel(tf.SwinConfig(**SWIN)), images),
        "swinv2": lambda: (tf.Swinv2Model(tf.Swinv2Config(**SWIN)), images),
        "donut_swin": lambda: (tf.DonutSwinModel(tf.DonutSwinConfig(**SWIN)), images),
        "vit": lambda: (tf.ViTModel(tf.ViTConfig(image_size=32, patch_size=8, **SMALL)),
                        {"pixel_values": torch.randn(2, 3, 32, 32, generator=g)}),
        "bert": lambda: (tf.BertModel(tf.BertConfig(vocab_size=100, **SMALL)),
                         {"input_ids": torch.randint(0, 100, (2, 12), generator=g)}),
    }
    torch.manual_seed(0)
    model, inputs = makers[name]()
    return model.eval(), inputs


class Phases:
    """Seconds spent in export (``export_module``) and in the passes (``run_amp_passes``)
    while active: the module's references to them are wrapped."""

    NAMES = {"export_module": amp_cache, "run_amp_passes": amp_module}  # where each is called

    def __enter__(self) -> Phases:
        self.seconds = dict.fromkeys(self.NAMES, 0.0)
        self.saved = {n: getattr(owner, n) for n, owner in self.NAMES.items()}
        for n, fn in self.saved.items():
            setattr(self.NAMES[n], n, self._timed(n, fn))
        return self

    def _timed(self, name: str, fn: Callable) -> Callable:
        def run(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - t0
        return run

    def __exit__(self, *exc: object) -> None:
        for n, fn in self.saved.items():
            setattr(self.NAMES[n], n, fn)


def first_output(out: object) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def one_run(name: str) -> dict:
    model, inputs = build(name)
    with torch.no_grad():
        ref = first_output(model(**inputs))
    with Phases() as phases, torch.no_grad():
        t0 = time.perf_counter()
        net = ampgraph.compile(model, "O2")
        out = first_output(net(**inputs))
        total = time.perf_counter() - t0
    a, b = out.detach().double().flatten(), ref.double().flatten()
    _, eager = net.amp_parts()
    return {"total_s": total, "export_s": phases.seconds["export_module"],
            "passes_s": phases.seconds["run_amp_passes"],
            "nodes": len(net._amp_last.gm.graph.nodes) if net._amp_last else 0,
            "eager_parts": len(eager),
            "cos": float(torch.nn.functional.cosine_similarity(a, b, dim=0))}


def warm_up() -> float:
    t0 = time.perf_counter()
    net = ampgraph.compile(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU()), "O2")
    with torch.no_grad():
        net(torch.randn(2, 8))
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="swin,swinv2,donut_swin,vit,bert")
    p.add_argument("--repeat", type=int, default=1,
                   help="time each model this many times; report the fastest and the median")
    p.add_argument("--json", default="bench_results/capture_time.json")
    args = p.parse_args(argv)
    print(f"warm-up (one-time costs, untimed below): {warm_up():.2f} s")
    print(f"{'model':<12}{'total s':>9}{'export s':>10}{'passes s':>10}{'nodes':>7}"
          f"{'eager':>7}{'cos':>9}  (median total of runs)")
    rows = []
    for name in args.models.split(","):
        runs = [one_run(name) for _ in range(args.repeat)]
        row = dict(min(runs, key=lambda r: r["total_s"]), model=name)
        row["total_s_median"] = statistics.median(r["total_s"] for r in runs)
        rows.append(row)
        print(f"{name:<12}{row['total_s']:>9.2f}{row['export_s']:>10.2f}{row['passes_s']:>10.2f}"
              f"{row['nodes']:>7}{row['eager_parts']:>7}{row['cos']:>9.5f}"
              f"  ({row['total_s_median']:.2f} of {len(runs)})")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
