"""Speed and memory on third-party models at realistic sizes: fp32, torch.autocast, O2, O2-inductor.

Run on demand (never as a timed test):

    python benchmarks/real_models.py                      # CPU, bf16, every model below
    python benchmarks/real_models.py --models bert,gpt2 --steps 5
    python benchmarks/real_models.py --device cuda        # when a GPU is lent
    python benchmarks/real_models.py --smoke              # tiny configs: harness check
    python benchmarks/real_models.py --device cuda --suite gpu   # the GPU suite (gpu_suite.py)
    python benchmarks/real_models.py --suite cnn                 # modern CNNs, batch 8 x 128 px
    python benchmarks/real_models.py --suite cnn --processes 0   # ... all modes in one process

The models are built as their libraries build them, from default configs (unless stated)
with random weights; nothing is downloaded:

- resnet50: torchvision ``resnet50()``, or HF ``ResNetForImageClassification(ResNetConfig())``
  (ResNet-50) when torchvision cannot be imported; batch 16 x 128 px;
- vit: torchvision ``vit_b_16()``, or HF ``ViTForImageClassification(ViTConfig())``
  (ViT-B/16); batch 8 x 224 px;
- bert: HF ``BertForSequenceClassification(BertConfig())`` (BERT-base, dropout 0.1); 8 x 128;
- gpt2: HF ``GPT2LMHeadModel(GPT2Config())`` (GPT-2 small, dropout 0.1); 4 x 128;
- llama: HF ``LlamaForCausalLM``, 4 layers, d=512, 8 heads, vocab 32000; 4 x 128.

``--suite cnn`` trains convolutional networks at the size a CPU user trains them, batch 8 x
128 px: ``convnext`` (HF ``ConvNextForImageClassification(ConvNextConfig())``, ConvNeXt-T:
7x7 depthwise convolutions, LayerNorm over channels, GELU MLPs) and ``resnet50`` (as above,
at batch 8).

Each model is trained the way a user would: their own loop, cross-entropy on the logits,
``torch.optim.AdamW``. Each mode runs in processes of its own (``--processes``, 2 by
default), as a user runs one of them: in one process the modes would share the C
allocator's heap, and which mode's large allocations find free pages there (or fault fresh
ones in) would depend on the mode run just before (we measured the same O2 LLaMA inference
10% faster or 15% slower than autocast by that alone). Even alone, a process's heap layout
is one sample that stays with it, so each mode's steps go to its processes in turn
(``ModeProcesses``). The parent steps the modes interleaved, one step each in turn, so
machine noise still hits all modes alike; the median of ``--steps`` steps (over all of a
mode's processes) after ``--warmup`` steps per process is reported. Peak memory is the peak
of live tensors in a training step (profiler allocation events, each mode in a fresh
subprocess; ``perf.peak_live_tensors_mib``). Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]

from perf import Mode, peak_live_tensors_mib, sync, time_interleaved  # noqa: E402

MODELS = ("resnet50", "vit", "bert", "gpt2", "llama")
CNN_MODELS = ("convnext", "resnet50")
MODES = ("fp32", "autocast", "O2", "O2-inductor")


def _torchvision() -> Any:
    try:
        import torchvision.models as tvm
    except Exception:  # noqa: BLE001 - the CPU torch cannot load its wheel's C ops
        return None
    return tvm


def build(name: str, smoke: bool, device: str, batch: int | None = None
          ) -> tuple[nn.Module, dict, Callable, str]:
    """(model, inputs as keywords, loss(out, labels), what was built); ``batch`` overrides the
    model's default batch size."""
    import transformers as tf

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tvm = _torchvision()
    if name == "convnext":
        px = 32 if smoke else 128
        config = tf.ConvNextConfig() if not smoke else tf.ConvNextConfig(
            hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1], num_labels=10)
        model, source = tf.ConvNextForImageClassification(config), "HF ConvNeXt-T"
        batch = batch or (2 if smoke else 8)
        inputs = {"pixel_values": torch.randn(batch, 3, px, px, generator=g)}
        labels = torch.randint(0, model.config.num_labels, (batch,), generator=g)
    elif name in ("resnet50", "vit"):
        vit = name == "vit"
        default, px, classes = (2, 32 if not vit else 32, 10) if smoke else (
            8 if vit else 16, 224 if vit else 128, 1000)
        batch = batch or default
        if tvm is not None and not smoke:
            model = tvm.vit_b_16() if vit else tvm.resnet50()
            source = "torchvision " + ("vit_b_16()" if vit else "resnet50()")
            key = "x"
        elif vit:
            config = tf.ViTConfig() if not smoke else tf.ViTConfig(
                hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                intermediate_size=64, image_size=px, patch_size=8)
            model, source, key = tf.ViTForImageClassification(config), "HF ViT-B/16", "pixel_values"
        else:
            config = tf.ResNetConfig() if not smoke else tf.ResNetConfig(
                embedding_size=8, hidden_sizes=[8, 16, 32, 64], depths=[1, 1, 1, 1])
            model, source, key = (tf.ResNetForImageClassification(config), "HF ResNet-50",
                                  "pixel_values")
        inputs = {key: torch.randn(batch, 3, px, px, generator=g)}
        labels = torch.randint(0, classes if tvm is not None else model.config.num_labels,
                               (batch,), generator=g)
    else:
        batch, seq = (2, 16) if smoke else ((8, 128) if name == "bert" else (4, 128))
        small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64, vocab_size=100)
        if name == "bert":
            model = tf.BertForSequenceClassification(tf.BertConfig(**(small if smoke else {})))
            source = "HF BERT-base"
        elif name == "gpt2":
            model = tf.GPT2LMHeadModel(tf.GPT2Config(**(
                dict(n_embd=32, n_layer=1, n_head=2, vocab_size=100) if smoke else {})))
            source = "HF GPT-2 small"
        else:
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**(small if smoke else dict(
                hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=8, intermediate_size=1376, vocab_size=32000))))
            source = "HF LLaMA-style 4x512"
        vocab = model.config.vocab_size
        ids = torch.randint(1, vocab, (batch, seq), generator=g)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        labels = ids if name != "bert" else torch.randint(0, 2, (batch,), generator=g)
    model = model.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    labels = labels.to(device)

    def loss(out: Any) -> torch.Tensor:
        logits = out if isinstance(out, torch.Tensor) else out.logits
        logits = logits.float()
        if logits.dim() == 3:  # next-token prediction
            return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                               labels[:, 1:].flatten())
        return nn.functional.cross_entropy(logits, labels)

    return model, inputs, loss, source


def user_mode(name: str, model: nn.Module, inputs: dict, loss: Callable, low: torch.dtype,
         device: str) -> Mode:
    """One way of running the model: the user's train step (plain AdamW, lr 1e-5) and an
    inference call, ``perf.Mode`` with keyword inputs."""
    return Mode(name, model, inputs, low, device, loss=loss, lr=1e-5, fused=False)


class ModeProcess:
    """A mode running in a process of its own: ``train_step()`` and ``infer()`` return when
    the process has run one (``perf.time_interleaved`` times them from here; a round trip
    costs well under a millisecond)."""

    def __init__(self, name: str, mode: str, args: argparse.Namespace):
        self.name = mode
        self.device = "cpu"  # the worker synchronises its own device
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_mode_worker, daemon=True, args=(
            child, name, mode, args.smoke, args.device, args.dtype, torch.get_num_threads(),
            args.batch))
        self._proc.start()  # builds while the other modes' processes start

    def ready(self) -> str:
        """Wait until the model is built and compiled; what was built."""
        return self._call("ready")

    def _call(self, cmd: str) -> str:
        self._conn.send(cmd)
        ok, reply = self._conn.recv()
        if not ok:
            raise RuntimeError(f"mode {self.name} failed: {reply}")
        return reply

    def train_step(self) -> None:
        self._call("train")

    def infer(self) -> None:
        self._call("infer")

    def close(self) -> None:
        self._conn.send("exit")
        self._proc.join()


class ModeProcesses:
    """A mode running in ``n`` processes of its own, its steps sent to them in turn.

    Whether a step's large fresh allocations fault their pages in or find free ones in the C
    allocator's heap depends on that heap's layout, which differs from process to process
    and stays with a process: one process per mode samples it once (we saw the same
    autocast LLaMA-style inference at 43 ms in one process and 52-57 in others). Medians
    over the steps of several processes average over it."""

    def __init__(self, name: str, mode: str, args: argparse.Namespace):
        self.name, self.device = mode, "cpu"
        self._procs = [ModeProcess(name, mode, args) for _ in range(args.processes)]
        self._turn = {"train": 0, "infer": 0}

    def ready(self) -> str:
        return [proc.ready() for proc in self._procs][0]

    def _next(self, what: str) -> ModeProcess:
        i = self._turn[what]
        self._turn[what] = i + 1
        return self._procs[i % len(self._procs)]

    def train_step(self) -> None:
        self._next("train").train_step()

    def infer(self) -> None:
        self._next("infer").infer()

    def close(self) -> None:
        for proc in self._procs:
            proc.close()


class InProcess:
    """A mode run in this process beside the others (``--processes 0``): what a user
    comparing autocast and ampgraph in one script sees, the C allocator's heap shared."""

    def __init__(self, mode: Mode, source: str):
        self.mode, self.name, self.device, self.source = mode, mode.name, mode.device, source

    def ready(self) -> str:
        return self.source

    def train_step(self) -> None:
        self.mode.train_step()

    def infer(self) -> None:
        self.mode.infer()

    def close(self) -> None:
        pass


def in_process(name: str, modes: list[str], args: argparse.Namespace) -> list[InProcess]:
    runs = []
    for mode in modes:
        model, inputs, loss, source = build(name, args.smoke, args.device, args.batch)
        runs.append(InProcess(user_mode(mode, model, inputs, loss, args.low, args.device),
                              source))
    return runs


def _mode_worker(conn: Any, name: str, mode: str, smoke: bool, device: str, dtype: str,
                 threads: int, batch: int | None) -> None:
    torch.set_num_threads(threads)
    try:
        model, inputs, loss, source = build(name, smoke, device, batch)
        low = torch.bfloat16 if dtype == "bf16" else torch.float16
        m = user_mode(mode, model, inputs, loss, low, device)
        del model
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        conn.recv()
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        return
    while (cmd := conn.recv()) != "exit":
        try:
            if cmd == "train":
                m.train_step()
            elif cmd == "infer":
                m.infer()
            sync(device)
            conn.send((True, source))
        except Exception as exc:  # noqa: BLE001 - reported to the parent
            conn.send((False, f"{type(exc).__name__}: {exc}"))


def peak_memory(args: argparse.Namespace, name: str, mode: str) -> float | None:
    if args.device == "cuda":
        model, inputs, loss, _ = build(name, args.smoke, "cuda", args.batch)
        m = user_mode(mode, model, inputs, loss, args.low, "cuda")
        m.train_step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        m.train_step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-probe", f"{name}:{mode}",
           "--dtype", args.dtype] + (["--smoke"] if args.smoke else []) + (
               ["--batch", str(args.batch)] if args.batch else [])
    out = subprocess.run(cmd, capture_output=True, text=True)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        print(f"memory probe {name}:{mode} failed: {out.stderr.strip()[-300:]}", file=sys.stderr)
        return None


def memory_probe(args: argparse.Namespace) -> None:
    """Peak live tensors of training steps above a baseline with the optimizer state
    allocated and no gradients (``perf.memory_probe`` explains the measure)."""
    name, mode = args.memory_probe.split(":")
    model, inputs, loss, _ = build(name, args.smoke, "cpu", args.batch)
    m = user_mode(mode, model, inputs, loss, args.low, "cpu")
    for p in m.model.parameters():
        p.grad = torch.zeros_like(p)
    m.opt.step()
    m.opt.zero_grad(set_to_none=True)
    print(peak_live_tensors_mib(m.train_step, warmup=1, measured=2))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="ampgraph on third-party models at real sizes")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="warm-up steps per process")
    p.add_argument("--processes", type=int, default=2,
                   help="processes per mode, stepped in turn (see ModeProcesses); 0: every "
                        "mode in this process, as a user comparing them in one script would")
    p.add_argument("--batch", type=int, help="batch size (default: each model's own)")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny configs, 1 step: harness check")
    p.add_argument("--json", default="bench_results/real_models.json")
    p.add_argument("--memory-probe", help=argparse.SUPPRESS)
    p.add_argument("--suite", default="cpu", choices=["cpu", "gpu", "cnn"],
                   help="gpu: GPU sizes, every mode in one process (benchmarks/gpu_suite.py); "
                        "cnn: ConvNeXt-T and ResNet-50 at batch 8 x 128 px")
    args = p.parse_args(argv)
    if args.suite == "gpu":
        import gpu_suite

        args.command = " ".join(["benchmarks/real_models.py"] + (argv or sys.argv[1:]))
        if args.models == ",".join(MODELS):
            args.models = ",".join(gpu_suite.MODELS)
        if args.modes == ",".join(MODES):
            args.modes = ",".join(gpu_suite.MODES)
        if args.smoke:
            args.steps, args.warmup = 1, 1
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        gpu_suite.run(args)
        return 0
    args.low = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    if args.processes < 0:
        p.error("--processes must be 0 (this process) or more")
    if args.suite == "cnn":
        if args.models == ",".join(MODELS):
            args.models = ",".join(CNN_MODELS)
        if args.modes == ",".join(MODES):
            args.modes = "autocast,O2"
        args.batch = args.batch or 8
    if args.memory_probe:
        memory_probe(args)
        return 0
    if args.smoke:
        args.steps, args.warmup, args.processes = 1, 1, min(args.processes, 1)
    modes = args.modes.split(",")
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__,
                    "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["benchmarks/real_models.py"] + (argv or sys.argv[1:])),
        "dtype": args.dtype, "batch": args.batch, "processes": args.processes, "models": {},
    }
    for name in args.models.split(","):
        runs = in_process(name, modes, args) if args.processes == 0 else [
            ModeProcesses(name, m, args) for m in modes]
        warmup = args.warmup * max(args.processes, 1)  # every process warms up
        entry = {"source": [run.ready() for run in runs][0],
                 "train": time_interleaved(runs, "train", args.steps, warmup),
                 "infer": time_interleaved(runs, "infer", args.steps, warmup)}
        if not args.no_memory:
            entry["peak_tensor_mib"] = {m: peak_memory(args, name, m) for m in modes
                                        if m != "O2-inductor"}
        results["models"][name] = entry
        print_table(name, entry, modes)
        for run in runs:
            run.close()
    ratios = [e[w]["autocast"]["median_ms"] / e[w]["O2"]["median_ms"]
              for e in results["models"].values() for w in ("train", "infer")
              if "O2" in e[w] and "autocast" in e[w]]
    if ratios:
        results["geomean_o2_vs_autocast"] = math.exp(sum(map(math.log, ratios)) / len(ratios))
        print(f"\ngeometric mean of O2/autocast speedups (train and inference): "
              f"{results['geomean_o2_vs_autocast']:.2f}x")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {args.json}")
    return 0


def print_table(name: str, entry: dict, modes: list[str]) -> None:
    tr, inf = entry["train"], entry["infer"]
    mem = entry.get("peak_tensor_mib", {})
    print(f"\n{name} ({entry['source']}): median ms (min-max); x autocast: >1 = faster")
    print(f"{'mode':13}{'train':>24}{'x autocast':>11}{'infer':>24}{'x autocast':>11}"
          f"{'peak MiB':>10}")
    for m in modes:
        t, i = tr[m], inf[m]
        peak = mem.get(m)
        print(f"{m:13}{t['median_ms']:10.1f} ({t['min_ms']:6.1f}-{t['max_ms']:6.1f})"
              f"{tr['autocast']['median_ms'] / t['median_ms']:11.2f}"
              f"{i['median_ms']:10.1f} ({i['min_ms']:6.1f}-{i['max_ms']:6.1f})"
              f"{inf['autocast']['median_ms'] / i['median_ms']:11.2f}"
              + (f"{peak:10.0f}" if peak is not None else ""))


if __name__ == "__main__":
    raise SystemExit(main())
