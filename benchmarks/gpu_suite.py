"""The GPU suite of ``benchmarks/real_models.py`` (``--device cuda --suite gpu``).

Five models at the sizes GPU users train them, every mode in one process with its own copy
of the same weights, steps interleaved (one step of each mode in turn), CUDA-synchronised
medians; the user's loop with ``torch.optim.AdamW`` (lr 1e-5), cross-entropy on fp32
logits. Per model and mode it records:

- train and inference medians (ms) and ratios to autocast bf16 (to autocast fp16 +
  GradScaler for O2 fp16);
- host enqueue time of a train step: the time until the step's Python returns, the device
  synchronised before it (a launch-bound step has it close to the step's time);
- peak memory of a train step above what was allocated before it
  (``torch.cuda.max_memory_allocated``);
- cast/copy kernels per train step (torch.profiler: device kernels whose name holds
  "copy" or "cast", and the ``aten::copy_`` / ``aten::_to_copy`` ops);
- eval cosine of the logits against fp32's.

Results go to ``--json`` as JSON lines, one per measurement, as they are taken, so a
time-out keeps what was measured. The modes:

- ``fp32``; ``autocast`` (bf16); ``autocast-fp16`` (+ ``torch.amp.GradScaler``);
- ``O2`` (bf16, the user's loop); ``O2-fp16`` (``ampgraph.build_train_step``, dynamic
  loss scale);
- ``floor``: the model cast to bf16 as a whole (no fp32 masters: the lower bound);
- ``autocast-compile`` (autocast + ``torch.compile``) and ``O2-inductor``
  (``backend="inductor"``): each compiles for tens of seconds per model;
- ``O2-graphed``: ``ampgraph.build_train_step(..., cuda_graph=True)``, the whole bf16 step
  as one CUDA graph; it needs a fused optimizer, ``torch.optim.AdamW(fused=True,
  capturable=True)``; ``autocast-fused`` and ``floor-fused``: autocast and the floor with
  that optimizer too, for a like-for-like comparison. Inference of ``O2-graphed`` is O2's
  eager inference (the same compiled module);
- ``O2-fp8`` and ``O2-fp8-inductor``: O2 with ``fp8=ampgraph.FP8Recipe()`` (the products
  that pass torchao's tensorwise rule in FP8, eager and with inductor); their rows say how
  many products ran FP8 (``fp8_products``). The model for them is ``llama4096`` (not in
  the default models: 2 LLaMA-3-8B layers, d=4096, 8 x 2048 tokens), run as
  ``--models llama4096 --modes O2,O2-fp8,O2-inductor,O2-fp8-inductor``.
"""

from __future__ import annotations

import copy
import json
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from perf import Mode
from torch import nn

import ampgraph

MODELS = ("bert", "gpt2", "llama", "resnet50", "vit")
MODES = ("fp32", "autocast", "autocast-fp16", "O2", "O2-fp16", "floor", "autocast-compile",
         "O2-inductor", "O2-graphed", "autocast-fused", "floor-fused")
FP8_MODES = ("O2-fp8", "O2-fp8-inductor")  # asked for by name


def build(name: str, smoke: bool, device: str) -> tuple[nn.Module, dict, Callable, str]:
    """(model, inputs as keywords, loss(out), what was built) at the GPU sizes."""
    import transformers as tf

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    small = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                 intermediate_size=64, vocab_size=100)
    if name in ("resnet50", "vit"):
        vit = name == "vit"
        batch, px = (2, 32) if smoke else ((64, 224) if vit else (128, 224))
        try:
            import torchvision.models as tvm
            model = (tvm.vit_b_16(image_size=px) if vit else tvm.resnet50()) if not smoke \
                else (tvm.VisionTransformer(px, 16, 1, 2, 32, 64) if vit else tvm.resnet18())
            source, key, classes = f"torchvision {'vit_b_16' if vit else 'resnet50'}", "x", 1000
        except Exception:  # noqa: BLE001 - torchvision cannot load with the CPU torch
            if vit:
                config = tf.ViTConfig(**(dict(small, image_size=px, patch_size=8)
                                         if smoke else {}))
                model, source = tf.ViTForImageClassification(config), "HF ViT-B/16"
            else:
                config = tf.ResNetConfig(**(dict(embedding_size=8, hidden_sizes=[8, 16, 32, 64],
                                                 depths=[1, 1, 1, 1]) if smoke else {}))
                model, source = tf.ResNetForImageClassification(config), "HF ResNet-50"
            key, classes = "pixel_values", model.config.num_labels
        inputs = {key: torch.randn(batch, 3, px, px, generator=g)}
        labels = torch.randint(0, classes, (batch,), generator=g)
    else:
        batch, seq = {"bert": (32, 512), "gpt2": (16, 512), "llama": (8, 1024),
                      "llama4096": (8, 2048)}[name]
        if smoke:
            batch, seq = 2, 16
        if name == "bert":
            model = tf.BertForSequenceClassification(tf.BertConfig(**(small if smoke else {})))
            source = "HF BERT-base"
        elif name == "gpt2":
            model = tf.GPT2LMHeadModel(tf.GPT2Config(**(
                dict(n_embd=32, n_layer=1, n_head=2, vocab_size=100) if smoke else {})))
            source = "HF GPT-2 small"
        elif name == "llama4096":  # FP8's products pass the rule: LLaMA-3-8B's layer shapes
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**(
                dict(small, hidden_size=64, intermediate_size=128, num_key_value_heads=1)
                if smoke else dict(hidden_size=4096, num_hidden_layers=2, num_attention_heads=32,
                                   num_key_value_heads=8, intermediate_size=14336,
                                   vocab_size=32000))))
            source = "HF LLaMA 2 layers d=4096 (LLaMA-3-8B's) GQA 32/8"
        else:
            model = tf.LlamaForCausalLM(tf.LlamaConfig(**(dict(small, num_key_value_heads=1)
                                                        if smoke else dict(
                hidden_size=1024, num_hidden_layers=8, num_attention_heads=16,
                num_key_value_heads=8, intermediate_size=2816, vocab_size=32000))))
            source = "HF LLaMA 8 layers d=1024 GQA 16/8"
        ids = torch.randint(1, model.config.vocab_size, (batch, seq), generator=g)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        labels = ids if name != "bert" else torch.randint(0, 2, (batch,), generator=g)
    model = model.to(device)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    labels = labels.to(device)

    def loss(out: Any) -> torch.Tensor:
        logits = logits_of(out).float()
        if logits.dim() == 3:  # next-token prediction
            return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1),
                                               labels[:, 1:].flatten())
        return nn.functional.cross_entropy(logits, labels)

    return model, inputs, loss, source


def logits_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


class GpuMode:
    """One way of running a model: the user's train step and an inference call."""

    def __init__(self, name: str, model: nn.Module, inputs: dict, loss: Callable,
                 device: str):
        self.name, self.inputs, self.loss, self.device = name, inputs, loss, device
        self.model = copy.deepcopy(model)
        self.low = torch.float16 if name.endswith("fp16") else torch.bfloat16
        self.autocast = name.startswith("autocast")
        self.scaler = self.step = None
        if name.startswith("floor"):
            self.model = self.model.to(torch.bfloat16)
            self.inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                           for k, v in inputs.items()}
        self.net: Any = self.model
        if name.startswith("O2"):
            fp8 = ampgraph.FP8Recipe() if "fp8" in name else None
            self.net = ampgraph.compile(self.model, "O2", self.low, fp8=fp8,
                                        backend="inductor" if name.endswith("inductor") else None)
        elif name == "autocast-compile":
            self.net = torch.compile(self.model)
        fused = name in ("O2-graphed", "autocast-fused", "floor-fused")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, **(
            dict(fused=True, capturable=True) if fused else {}))
        if name == "autocast-fp16":
            self.scaler = torch.amp.GradScaler(device)
        elif name == "O2-fp16":
            self.step = ampgraph.build_train_step(self.net, lambda out, _: loss(out), self.opt)
        elif name == "O2-graphed":
            self.step = ampgraph.build_train_step(self.net, lambda out, _: loss(out), self.opt,
                                                  cuda_graph=True)
        self.skipped = 0

    def forward(self) -> Any:
        if self.autocast:
            with torch.autocast(self.device, self.low):
                return self.net(**self.inputs)
        return self.net(**self.inputs)

    def train_step(self) -> None:
        if self.step is not None:
            self.model.train()
            self.step(None, **self.inputs)
        else:  # the user's loop, as perf.py's modes run it
            Mode.train_step(self)

    def infer(self) -> Any:
        self.model.eval()
        with torch.no_grad():
            return self.forward()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved(modes: list[GpuMode], what: str, steps: int, warmup: int
                ) -> dict[str, dict[str, float]]:
    """Median, min and max ms per mode, and the median host time of the call."""
    times: dict[str, list[tuple[float, float]]] = {m.name: [] for m in modes}
    for i in range(steps + warmup):
        for m in modes:
            _sync(m.device)
            t0 = time.perf_counter()
            m.train_step() if what == "train" else m.infer()
            t1 = time.perf_counter()
            _sync(m.device)
            if i >= warmup:
                times[m.name].append((1000 * (time.perf_counter() - t0), 1000 * (t1 - t0)))
    return {k: {"median_ms": statistics.median(t for t, _ in v),
                "min_ms": min(t for t, _ in v), "max_ms": max(t for t, _ in v),
                "host_ms": statistics.median(h for _, h in v)} for k, v in times.items()}


def peak_mib(m: GpuMode) -> float | None:
    if m.device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    m.train_step()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def copy_kernels(m: GpuMode) -> dict[str, int]:
    """Cast/copy work of one train step, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if m.device == "cuda" else [])
    with profile(activities=acts) as prof:
        m.train_step()
        _sync(m.device)
    counts = {"copy_": 0, "_to_copy": 0, "copy_kernels": 0, "kernels": 0}
    for e in prof.events():
        if e.name == "aten::copy_":
            counts["copy_"] += 1
        elif e.name == "aten::_to_copy":
            counts["_to_copy"] += 1
        if e.device_type == torch.autograd.DeviceType.CUDA:
            counts["kernels"] += 1
            low = e.name.lower()
            if "copy" in low or "cast" in low:
                counts["copy_kernels"] += 1
    return counts


def cosine(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """None where fp32's logits are all zero (torchvision's ViT head starts at zero)."""
    if not b.any():
        return None
    return nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(),
                                           dim=0).item()


def run(args: Any) -> dict:
    """The suite; each measurement appended to ``args.json`` as a JSON line."""
    device = args.device
    modes = [m for m in args.modes.split(",") if m]
    out = open(args.json, "w")  # noqa: SIM115 - written line by line until the end

    def record(**row: Any) -> None:
        out.write(json.dumps(row) + "\n")
        out.flush()
        print(json.dumps(row), flush=True)

    record(kind="machine", torch=torch.__version__, date=time.strftime("%Y-%m-%d %H:%M"),
           device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
           command=args.command, modes=modes)
    summary: dict[str, Any] = {}
    for name in [m for m in args.models.split(",") if m]:
        t0 = time.perf_counter()
        model, inputs, loss, source = build(name, args.smoke, device)
        runs = []
        for mode in modes:
            try:
                runs.append(GpuMode(mode, model, inputs, loss, device))
            except Exception as exc:  # noqa: BLE001 - reported, the suite goes on
                record(kind="error", model=name, mode=mode, error=f"{type(exc).__name__}: {exc}")
        del model
        ref = None
        evals = {}
        for m in runs:  # first calls capture and compile; the eval outputs compared
            evals[m.name] = logits_of(m.infer()).float()
        ref = evals.get("fp32")
        setup_s = time.perf_counter() - t0
        train = interleaved(runs, "train", args.steps, args.warmup)
        infer = interleaved(runs, "infer", args.steps, args.warmup)
        entry: dict[str, Any] = {}
        for m in runs:
            row = dict(kind="result", model=name, source=source, mode=m.name,
                       train_ms=train[m.name]["median_ms"], infer_ms=infer[m.name]["median_ms"],
                       train_host_ms=train[m.name]["host_ms"],
                       train_min_max=[train[m.name]["min_ms"], train[m.name]["max_ms"]])
            base = {"O2-fp16": "autocast-fp16", "floor-fused": "autocast-fused"}.get(
                m.name, "autocast")
            if base in train:
                row["train_x"] = train[base]["median_ms"] / row["train_ms"]
                row["infer_x"] = infer[base]["median_ms"] / row["infer_ms"]
            if ref is not None:
                row["eval_cosine_vs_fp32"] = cosine(evals[m.name], ref)
            if not m.name.endswith(("compile", "inductor")):
                row["peak_mib"] = peak_mib(m)
                row.update(copy_kernels(m))
            if m.step is not None and m.step.graphs is not None:
                # a graph's memory pool is reserved at capture, not allocated by a replay:
                # peak_mib misses it; the process-wide reserved bytes include it
                row["graphs"] = m.step.graphs.captures
                row["reserved_mib"] = torch.cuda.memory_reserved() / 2**20
            if "fp8" in m.name:
                row["fp8_products"] = sum(r["precision"] == "fp8"
                                          for r in ampgraph.explain(m.net).nodes)
            if m.name.startswith("O2"):
                row["working_copies_mib"] = sum(
                    c.numel() * c.element_size() for c in m.net.working_copies()) / 2**20
            record(**row)
            entry[m.name] = row
        record(kind="model_done", model=name, setup_s=setup_s,
               total_s=time.perf_counter() - t0)
        summary[name] = entry
        del runs, evals, ref
        if device == "cuda":
            torch.cuda.empty_cache()
    ratios = [e["O2"][k] for e in summary.values() if "O2" in e for k in ("train_x", "infer_x")
              if k in e["O2"]]
    if ratios:
        record(kind="geomean", o2_vs_autocast=math.exp(sum(map(math.log, ratios)) / len(ratios)))
    out.close()
    return summary
