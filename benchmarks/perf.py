"""Speed and memory of ampgraph against FP32, torch.autocast and the all-low-precision floor.

Run on demand (never as a timed test):

    python benchmarks/perf.py                       # CPU, bf16, mlp/resnet/bert
    python benchmarks/perf.py --device cuda --dtype fp16 --batch-scale 8
    python benchmarks/perf.py --smoke               # tiny sizes: checks the harness runs

Every mode is timed in one process, interleaved step by step (so machine noise hits all
modes alike); the median of ``--steps`` steps after ``--warmup`` is reported with min/max.
Modes: fp32 eager, torch.autocast (+GradScaler for fp16), ampgraph O1/O2/O3, the whole
model cast to the low dtype ("floor": fast, numerically unsafe), and O2 through
torch.compile with ``--inductor``. Peak memory of a training step is measured per mode:
on CUDA with ``max_memory_allocated``; on CPU as the peak RSS of steady-state steps above a
shared baseline (see ``memory_probe``), each mode in a fresh subprocess. Prints a table and
writes JSON.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ampgraph  # noqa: E402
from ampgraph.demo import load_reference_model  # noqa: E402

SIZES = {  # (model file, make_model kwargs, batch) where matrix work dominates
    "mlp": ("tabular_mlp", dict(in_features=1024, hidden=4096, depth=2, out_features=1024), 256),
    "resnet": ("resnet", dict(width=64), 64),
    "bert": ("bert_encoder", dict(d_model=512, n_layers=4, n_heads=8, d_ff=2048, vocab_size=8000,
                                  max_len=128), 16),
}
SMOKE = {
    "mlp": ("tabular_mlp", dict(in_features=32, hidden=64, depth=2, out_features=8), 8),
    "resnet": ("resnet", dict(width=8), 2),
    "bert": ("bert_encoder", dict(d_model=32, n_layers=1, n_heads=2, d_ff=64, vocab_size=100,
                                  max_len=32), 2),
}
SEQ = 64


def build(name: str, smoke: bool, device: str, batch_scale: int = 1) -> tuple[nn.Module, tuple]:
    file, kwargs, batch = (SMOKE if smoke else SIZES)[name]
    mod = load_reference_model(file)
    torch.manual_seed(0)
    model = mod.make_model(**kwargs).to(device)
    batch *= batch_scale
    if name == "bert":
        seq = 16 if smoke else SEQ
        ids = torch.randint(1, kwargs["vocab_size"], (batch, seq), device=device)
        mask = torch.ones(batch, seq, dtype=torch.long, device=device)
        return model, (ids, mask)
    x = mod.example_inputs(batch)[0] if name != "mlp" else torch.randn(batch, kwargs[
        "in_features"])
    return model, (x.to(device),)


def loss_of(out: torch.Tensor) -> torch.Tensor:
    return out.float().square().mean()


class Mode:
    """One way of running the model: a train step and an inference call.

    ``inputs`` are positional (a tuple) or keywords (a dict); ``loss`` maps the output to
    the training loss; the optimizer is AdamW, fused unless ``fused=False``.
    """

    def __init__(self, name: str, model: nn.Module, inputs: tuple | dict, dtype: torch.dtype,
                 device: str, *, loss: Any = None, lr: float = 1e-4, fused: bool = True):
        self.name = name
        self.model = copy.deepcopy(model)
        self.inputs = inputs
        self.device = device
        self.dtype = dtype
        self.loss = loss or loss_of
        self.scaler = None
        if name == "floor":
            self.model = self.model.to(dtype)
            low = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731
            self.inputs = ({k: low(t) for k, t in inputs.items()} if isinstance(inputs, dict)
                           else tuple(map(low, inputs)))
            self.net = self.model
        elif name.startswith("O"):
            level, _, backend = name.partition("-")
            self.net = ampgraph.compile(self.model, level, dtype, backend=backend or None)
        else:
            self.net = self.model
            if name == "autocast" and dtype == torch.float16:
                self.scaler = torch.amp.GradScaler(device)
        # fused AdamW (CPU and CUDA): the fast optimizer a speed-minded user picks, for all modes
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=fused)

    def forward(self) -> Any:
        if self.name == "autocast":
            with torch.autocast(self.device, self.dtype):
                return self._call()
        return self._call()

    def _call(self) -> Any:
        if isinstance(self.inputs, dict):
            return self.net(**self.inputs)
        return self.net(*self.inputs)

    def train_step(self) -> None:
        self.model.train()
        loss = self.loss(self.forward())
        self.opt.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.opt)
            self.scaler.update()
        else:
            loss.backward()
            self.opt.step()

    def infer(self) -> None:
        self.model.eval()
        with torch.no_grad():
            self.forward()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_interleaved(modes: list[Mode], what: str, steps: int, warmup: int) -> dict:
    times: dict[str, list[float]] = {m.name: [] for m in modes}
    for i in range(steps + warmup):
        for m in modes:
            fn = m.train_step if what == "train" else m.infer
            sync(m.device)
            t0 = time.perf_counter()
            fn()
            sync(m.device)
            if i >= warmup:
                times[m.name].append(1000 * (time.perf_counter() - t0))
    return {k: {"median_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v)}
            for k, v in times.items()}


def peak_memory(args: argparse.Namespace, model_name: str, mode: str) -> dict | None:
    """MiB a training step adds at its peak: CUDA allocator, or on CPU the peak of live
    tensors and of RSS (see ``memory_probe``)."""
    if args.device == "cuda":
        model, inputs = build(model_name, args.smoke, "cuda", args.batch_scale)
        m = Mode(mode, model, inputs, args.low, "cuda")
        m.train_step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        for _ in range(2):
            m.train_step()
        torch.cuda.synchronize()
        return {"tensors": (torch.cuda.max_memory_allocated() - base) / 2**20}
    result = {}
    for measure in ("tensors", "rss"):
        cmd = [sys.executable, os.path.abspath(__file__), "--memory-probe",
               f"{model_name}:{mode}:{measure}", "--dtype", args.dtype] + (
                   ["--smoke"] if args.smoke else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        try:
            result[measure] = float(out.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            pass
    return result or None


def _status_kib(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in KiB. Not ru_maxrss: after fork+exec
    that still counts the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory_probe(args: argparse.Namespace) -> None:
    """Peak memory of steady-state training steps above a baseline every mode shares.

    Baseline: torch.export and friends imported (a tiny model compiled and stepped), the
    model built and its optimizer state allocated, no gradients. Then two warm-up steps
    (capture) and three measured steps. One of two measures (each probe is a fresh process:
    the profiler's own buffers would inflate the RSS):

    - ``rss``: peak RSS of the measured steps above the baseline's RSS (the peak counter is
      reset after warm-up, Linux ``clear_refs`` 5). What the process really uses, but the
      allocator's caching makes repeated probes differ by up to ~15 MiB.
    - ``tensors``: peak bytes of live tensors during the measured steps above the baseline,
      from the profiler's allocation events (started at the baseline, so what a mode keeps
      between steps, working copies and gradient buffers, counts). Deterministic: the CPU
      counterpart of CUDA's ``max_memory_allocated``.
    """
    model_name, mode, measure = args.memory_probe.split(":")
    tiny, tiny_inputs = build(model_name, True, "cpu")
    Mode(mode, tiny, tiny_inputs, args.low, "cpu").train_step()
    model, inputs = build(model_name, args.smoke, "cpu")
    m = Mode(mode, model, inputs, args.low, "cpu")
    for p in m.model.parameters():  # allocate the optimizer state (AdamW: 2 per parameter)
        p.grad = torch.zeros_like(p)
    m.opt.step()
    m.opt.zero_grad(set_to_none=True)
    gc.collect()
    if measure == "rss":
        base = _status_kib("VmRSS")
        for _ in range(2):
            m.train_step()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        for _ in range(3):
            m.train_step()
        print((_status_kib("VmHWM") - base) / 1024)
        return
    print(peak_live_tensors_mib(m.train_step))


def peak_live_tensors_mib(step: Any, warmup: int = 2, measured: int = 3) -> float:
    """Peak MiB of live tensors during ``measured`` calls of ``step`` (after ``warmup``),
    above what was live when profiling started, from the profiler's allocation events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        for _ in range(warmup):
            step()
        t_measured = time.time_ns()
        for _ in range(measured):
            step()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for t, n in events:
        live += n
        if t >= t_measured:
            peak = max(peak, live)
    return peak / 2**20


def compile_timing(args: argparse.Namespace) -> dict:
    """compile + first step of a BERT-base-sized encoder (eager backend)."""
    kwargs = dict(d_model=768, n_layers=12, n_heads=12, d_ff=3072, vocab_size=30522, max_len=512)
    if args.smoke:
        kwargs = SMOKE["bert"][1]
    mod = load_reference_model("bert_encoder")
    model = mod.make_model(**kwargs)
    ids = torch.randint(1, kwargs["vocab_size"], (2, 32))
    mask = torch.ones(2, 32, dtype=torch.long)
    t0 = time.perf_counter()
    net = ampgraph.compile(model, "O2", args.low)
    loss_of(net(ids, mask)).backward()
    total = time.perf_counter() - t0
    nodes = len(ampgraph.explain(net).nodes)
    return {"model": "bert-base-sized encoder (12x768)", "graph_nodes": nodes,
            "compile_plus_first_step_s": round(total, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ampgraph speed/memory benchmark")
    p.add_argument("--models", default="mlp,resnet,bert")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-scale", type=int, default=1)
    p.add_argument("--levels", default="O1,O2,O3")
    p.add_argument("--inductor", action="store_true", help="also time O2 with torch.compile")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--compile-time", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 2 steps: harness check")
    p.add_argument("--json", default="bench_results/perf.json")
    p.add_argument("--memory-probe", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.low = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.memory_probe:
        memory_probe(args)
        return 0
    if args.smoke:
        args.steps, args.warmup = 2, 1
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    modes = ["fp32", "autocast", *args.levels.split(","), "floor"]
    if args.inductor:
        modes.append("O2-inductor")
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "processor": platform.processor(),
                    "threads": torch.get_num_threads(), "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join([os.path.basename(sys.argv[0])] + (argv or sys.argv[1:])),
        "dtype": args.dtype, "models": {},
    }
    for name in args.models.split(","):
        model, inputs = build(name, args.smoke, args.device, args.batch_scale)
        runs = [Mode(m, model, inputs, args.low, args.device) for m in modes]
        entry = {"train": time_interleaved(runs, "train", args.steps, args.warmup),
                 "infer": time_interleaved(runs, "infer", args.steps, args.warmup)}
        if not args.no_memory:
            entry["peak_mib"] = {m: peak_memory(args, name, m) for m in modes
                                 if m != "O2-inductor"}
        results["models"][name] = entry
        print_table(name, entry, modes)
    if args.compile_time:
        results["compile"] = compile_timing(args)
        print(results["compile"])
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.json}")
    return 0


def print_table(name: str, entry: dict, modes: list[str]) -> None:
    tr, inf = entry["train"], entry["infer"]
    print(f"\n{name}: median ms (min-max); ratios vs autocast (>1 = faster) and vs floor")
    print(f"{'mode':12}{'train':>22}{'x autocast':>11}{'/ floor':>9}{'infer':>22}"
          f"{'x autocast':>11}{'tensor MiB':>11}{'RSS MiB':>9}")
    for m in modes:
        t, i = tr[m], inf[m]
        mem = entry.get("peak_mib", {}).get(m) or {}
        print(f"{m:12}{t['median_ms']:9.1f} ({t['min_ms']:5.1f}-{t['max_ms']:5.1f})"
              f"{tr['autocast']['median_ms'] / t['median_ms']:11.2f}"
              f"{t['median_ms'] / tr['floor']['median_ms']:9.2f}"
              f"{i['median_ms']:9.1f} ({i['min_ms']:5.1f}-{i['max_ms']:5.1f})"
              f"{inf['autocast']['median_ms'] / i['median_ms']:11.2f}"
              + "".join(f"{mem[k]:{w}.0f}" if k in mem else " " * w
                        for k, w in (("tensors", 11), ("rss", 9))))


if __name__ == "__main__":
    raise SystemExit(main())
