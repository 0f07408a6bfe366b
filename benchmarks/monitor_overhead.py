"""Overhead of ``NumericsMonitor`` on the reference BERT-style model (a benchmark, not a test).

Run on demand from the repository root:

    python benchmarks/monitor_overhead.py                      # CPU, bf16, every=10, grads
    python benchmarks/monitor_overhead.py --device cuda --dtype fp16
    python benchmarks/monitor_overhead.py --track grads,weights,optimizer --every 10
    python benchmarks/monitor_overhead.py --smoke               # tiny sizes: harness check

Two identical models are trained with ``ampgraph.build_train_step`` (AdamW), one without a
monitor and one with ``NumericsMonitor(every, track, log_dir=<tmp>)`` (JSON lines written).
Blocks of ``every`` steps alternate between the two (order flipped every round, so machine
noise hits both alike) and the overhead is the ratio of their total times. Because one
logged step in ``every`` carries all of the cost, the script also times the logged-step
work alone (``after_backward`` on a step index that logs, 10 times) and reports it amortised
over ``every`` steps, from medians and from minima (the minima are the least disturbed by
other load): the less noisy estimate on a busy machine.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ampgraph  # noqa: E402
from ampgraph.demo import load_reference_model  # noqa: E402
from ampgraph.monitor import NumericsMonitor  # noqa: E402

# The "bert" size of benchmarks/perf.py: 4 post-LN layers, d_model 512, 16.7M parameters.
BERT = dict(d_model=512, n_layers=4, n_heads=8, d_ff=2048, vocab_size=8000, max_len=128)
SMOKE = dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, vocab_size=100, max_len=32)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bf16 | fp16 (default: fp16 on CUDA, "
                                                 "bf16 on CPU, where fp16 is emulated)")
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--track", default="grads", help="comma-separated NumericsMonitor track")
    p.add_argument("--rounds", type=int, default=6, help="alternating block pairs timed")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--smoke", action="store_true")
    args = p.parse_args(argv)
    dtype = args.dtype or ("fp16" if args.device == "cuda" else "bf16")
    sizes, batch, seq = (SMOKE, 2, 16) if args.smoke else (BERT, args.batch, args.seq)
    warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on a CPU

    mod = load_reference_model("bert_encoder")
    torch.manual_seed(0)
    base = mod.make_model(**sizes).to(args.device)
    ids = torch.randint(1, sizes["vocab_size"], (batch, seq), device=args.device)
    mask = torch.ones(batch, seq, dtype=torch.long, device=args.device)
    labels = torch.randint(0, 2, (batch,), device=args.device)
    track = tuple(t for t in args.track.split(",") if t)

    def build(monitor: NumericsMonitor | None) -> ampgraph.TrainStep:
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return ampgraph.build_train_step(model, torch.nn.functional.cross_entropy, opt,
                                         "O2", dtype, monitor=monitor)

    with tempfile.TemporaryDirectory() as log_dir:
        mon = NumericsMonitor(every=args.every, log_dir=log_dir, track=track)
        steps = {"plain": build(None), "monitor": build(mon)}

        def block(name: str) -> float:
            step = steps[name]
            sync(args.device)
            t0 = time.perf_counter()
            for _ in range(args.every):
                step(ids, mask, labels)
            sync(args.device)
            return time.perf_counter() - t0

        for name in steps:  # capture, first overflows, allocator warm-up
            block(name)
        times: dict[str, list[float]] = {"plain": [], "monitor": []}
        for r in range(args.rounds):
            for name in (("plain", "monitor") if r % 2 == 0 else ("monitor", "plain")):
                times[name].append(block(name))

        # the logged-step work alone, on the monitored step's current gradients
        ts = steps["monitor"]
        logged = []
        for _ in range(10):
            sync(args.device)
            t0 = time.perf_counter()
            mon.after_backward(0, ts.module, ts.optimizer, ts.loss_scale_manager.scale
                               if ts.loss_scale_manager else torch.ones(()), torch.zeros(()))
            sync(args.device)
            logged.append(time.perf_counter() - t0)
        layers = len(mon.summary())

    plain, monitored = sum(times["plain"]), sum(times["monitor"])
    step_ms = 1e3 * statistics.median(times["plain"]) / args.every
    log_ms = 1e3 * statistics.median(logged)
    ratios = [m / q - 1 for m, q in zip(times["monitor"], times["plain"])]
    n_params = sum(p.numel() for p in base.parameters())
    print(f"model: bert_encoder {sizes}, {n_params / 1e6:.1f}M parameters, batch {batch}x{seq}, "
          f"{args.device} {dtype}, O2, AdamW; torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"monitor: every={args.every}, track={track}, {layers} layers, JSON lines written")
    print(f"step time without monitor: {step_ms:.1f} ms (median of {args.rounds} blocks of "
          f"{args.every})")
    fastest = min(times["monitor"]) / min(times["plain"]) - 1
    print(f"A/B overhead: {100 * (monitored / plain - 1):+.2f}% total, "
          f"{100 * statistics.median(ratios):+.2f}% median of rounds, {100 * fastest:+.2f}% "
          f"fastest block vs fastest block; per round "
          f"{', '.join(f'{100 * r:+.1f}%' for r in ratios)}")
    print(f"logged-step work alone: {log_ms:.1f} ms -> {log_ms / args.every:.2f} ms per step "
          f"amortised = {100 * log_ms / args.every / step_ms:.2f}% of a step (medians)")
    fast_log_ms, fast_step_ms = 1e3 * min(logged), 1e3 * min(times["plain"]) / args.every
    print(f"fastest logged step {fast_log_ms:.1f} ms, fastest step {fast_step_ms:.1f} ms -> "
          f"{100 * fast_log_ms / args.every / fast_step_ms:.2f}% of a step (minima: least "
          f"disturbed by other load)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
