"""Step time of ``build_train_step`` with the head and loss fused (the default) against
``head_loss="off"``, side by side in one process (issue 46).

The models and batches are ``benchmarks/memory.py``'s (HF LLaMA d=512, 4 layers, 2 x 512
tokens, vocabulary 32000 or 128256; GPT-2 small; BERT-base masked LM), one copy of the
initial weights per mode, AdamW(lr 1e-4). The modes' steps are interleaved (one each in
turn), so the machine's noise hits both alike; the median of ``--steps`` steps after
``--warmup`` is reported, with the ratio unfused / fused (above 1: the fused step is
faster).

Usage:
    python benchmarks/head_loss_speed.py [--models llama32k,llama128k] [--steps 8]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory  # noqa: E402 - benchmarks/, the script's folder

import ampgraph  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="llama32k,llama128k")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for name in args.models.split(","):
        model, inputs = memory.build(name)
        steps = {}
        for mode, head_loss in (("unfused", "off"), ("fused", "auto")):
            m = copy.deepcopy(model)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            steps[mode] = ampgraph.build_train_step(m, None, opt, "O2", "bf16",
                                                    head_loss=head_loss)
        times = {mode: [] for mode in steps}
        for i in range(args.warmup + args.steps):
            for mode, step in steps.items():
                t0 = time.perf_counter()
                float(step(**inputs).loss)
                if i >= args.warmup:
                    times[mode].append(time.perf_counter() - t0)
        med = {mode: statistics.median(t) * 1e3 for mode, t in times.items()}
        print(f"{name}: unfused {med['unfused']:.0f} ms, fused {med['fused']:.0f} ms "
              f"(x {med['unfused'] / med['fused']:.2f})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
