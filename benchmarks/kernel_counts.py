"""Kernels a GPU train step launches, counted on the CPU: autocast, O2 and the bf16 floor.

Run on demand (a few minutes on a CPU; no GPU needed):

    python benchmarks/kernel_counts.py                    # all five models, real depths
    python benchmarks/kernel_counts.py --models gpt2 --diff   # + O2's ops against the floor's
    python benchmarks/kernel_counts.py --smoke            # one layer each: harness check

A GPU step at real sizes is launch-bound (shared/GPU.md), so the number of kernels it
launches is worth counting on its own. ``compile(..., runtime="cuda")`` runs on CPU tensors
and dispatches the aten ops it would on a GPU, so a ``TorchDispatchMode`` counting the ops
of one full train step of a tiny-width model tells how many kernels the GPU step launches,
without a GPU. HF models are built from their configs with random weights (nothing is
downloaded), at tiny width (hidden 32) but real depth: BERT (12 layers,
``BertForSequenceClassification``), GPT-2 (12, ``GPT2LMHeadModel``), LLaMA (8, 4 heads over
2 key/value heads: GQA), ViT (12, ``ViTForImageClassification``), ResNet-50
(``ResNetForImageClassification``, depths 3-4-6-3). Batch 2, 16 tokens or 32 px.

The step is the user's: forward, cross-entropy on the logits in fp32 (next-token for the
language models), backward, ``torch.optim.AdamW(fused=False, foreach=True)`` step,
``zero_grad(set_to_none=True)``. Two warm-up steps (capture, optimizer state), then the
third is counted. Modes, each on its own copy of the same weights:

- ``autocast``: ``torch.autocast("cpu", torch.bfloat16)``. CUDA's autocast cannot run on CPU
  tensors; CPU autocast lowers the same products (linear, matmul, bmm, convolution,
  attention) but keeps fewer ops fp32: CUDA's also runs softmax, layer norm, ``exp``,
  ``pow``, ``sum`` ... in fp32, with a cast in and out of each. So this column is a lower
  bound on CUDA autocast's casts and ops.
- ``O2``: ``ampgraph.compile(model, "O2", "bf16", runtime="cuda")``.
- ``floor``: ``model.to(torch.bfloat16)``, float inputs bf16: no fp32 anywhere but the loss.

What is counted, per op the dispatch mode sees (the ops below autograd: what a backend
runs):

- kernel: every op but views (an output that aliases an input without writing it:
  ``view``, ``t``, ``expand``, ``slice``, ``detach``, ``_unsafe_view`` ...), allocations
  and host-side ops (``_local_scalar_dense``, ``item``, ``is_nonzero``, ``equal``,
  ``sym_size`` ...). A multi-tensor ``_foreach_*`` op counts once (a GPU splits long lists
  into a few launches of ~100 tensors each).
- cast: a kernel that copies between float dtypes: ``_to_copy``, ``copy_`` or
  ``_foreach_copy_`` whose source and destination dtypes differ (one ``_foreach_copy_``
  counts once).
- alloc: ``empty``, ``empty_strided``, ``empty_like``, ``new_empty``, ``new_empty_strided``,
  ``empty_permuted``, ``resize_`` (the caching allocator serves them; host time only).
- sync: ``_local_scalar_dense``, ``item``, ``is_nonzero``, ``equal``, ``nonzero`` in forward
  and backward (the optimizer's step counters are CPU tensors on a GPU as well, so its
  ``item`` calls are no device syncs and are left out).

Dropout is off (p=0) in every config: on the CPU ``F.dropout`` runs as three ops
(``bernoulli_``, ``div_``, ``mul``), on CUDA as one ``native_dropout``, and a CPU attention
with dropout takes the unfused math path (a dozen ops) where CUDA runs one fused kernel.
With p=0 attention takes the CPU's fused kernel (one op forward, one backward), as a GPU's
would. The CUDA runtime's parameter groups hold up to 16M elements, so every tiny model is
one group: one ``_foreach_copy_`` in forward and one in backward (a real BERT-base has
seven groups).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ampgraph  # noqa: E402

MODELS = ("bert", "gpt2", "llama", "vit", "resnet50")
MODES = ("autocast", "O2", "floor")
ALLOCATIONS = frozenset({"empty", "empty_strided", "empty_like", "new_empty",
                         "new_empty_strided", "empty_permuted", "resize_"})
SYNCS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "nonzero"})
HOST_ONLY = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "sym_size",
                       "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
                       "_has_compatible_shallow_copy_type", "is_pinned", "record_stream",
                       "set_", "_version"})
# no alias annotation in their schemas, but views of a contiguous input (no kernel)
VIEW_LIKE = frozenset({"_unsafe_view", "_reshape_alias", "alias", "lift_fresh",
                       "_conj", "_neg_view"})
COPIES = frozenset({"_to_copy", "copy_", "_foreach_copy_"})


def is_view(func: Any) -> bool:
    """Whether ``func`` returns views of its inputs (every output aliased, none written)."""
    name = func.overloadpacket.__name__
    if name in VIEW_LIKE:
        return True
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in returns)


def _float_dtypes(value: Any) -> set[torch.dtype]:
    return {t.dtype for t in tree_flatten(value)[0]
            if isinstance(t, torch.Tensor) and t.is_floating_point()}


def is_cast(name: str, args: tuple, out: Any) -> bool:
    """Whether a copy op changes a float dtype (``_to_copy``: its input against its output;
    ``copy_`` / ``_foreach_copy_``: source against destination)."""
    if name not in COPIES:
        return False
    dst, src = (out, args[0]) if name == "_to_copy" else (args[0], args[1])
    dst_types, src_types = _float_dtypes(dst), _float_dtypes(src)
    return bool(dst_types and src_types) and dst_types != src_types


class KernelCounter(TorchDispatchMode):
    """Counts kernels, casts, allocations and host syncs per op name (module docstring).

    ``phase`` names what runs ("fwd", "bwd", "opt"); syncs count outside "opt" only.

    Example:
        >>> with KernelCounter() as counter:
        ...     torch.ones(3).add(1).to(torch.bfloat16)
        >>> counter.totals()["casts"]
        1
    """

    def __init__(self) -> None:
        super().__init__()
        self.kernels: Counter[str] = Counter()
        self.casts: Counter[str] = Counter()
        self.allocs: Counter[str] = Counter()
        self.syncs: Counter[str] = Counter()
        self.phase = "fwd"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if any(isinstance(t, FakeTensor) for t in tree_flatten((args, kwargs))[0]):
            return out  # capture-time tracing, not a run
        name = func.overloadpacket.__name__
        if name in SYNCS and self.phase != "opt":
            self.syncs[name] += 1
        if name in ALLOCATIONS:
            self.allocs[name] += 1
        elif name not in HOST_ONLY and not is_view(func):
            self.kernels[name] += 1
            if is_cast(name, args, out):
                self.casts[name] += 1
        return out

    def totals(self) -> dict[str, int]:
        return {"kernels": sum(self.kernels.values()), "casts": sum(self.casts.values()),
                "allocs": sum(self.allocs.values()), "syncs": sum(self.syncs.values())}


def build(name: str, smoke: bool) -> tuple[nn.Module, dict, torch.Tensor]:
    """(model, inputs as keywords, labels) for ``name``: tiny width, real depth (one layer
    with ``smoke``), dropout off."""
    import transformers as tf

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    width = dict(hidden_size=32, intermediate_size=64, num_attention_heads=2)
    if name in ("vit", "resnet50"):
        if name == "vit":
            model = tf.ViTForImageClassification(tf.ViTConfig(
                **width, num_hidden_layers=1 if smoke else 12, image_size=32, patch_size=8,
                num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
        else:
            model = tf.ResNetForImageClassification(tf.ResNetConfig(
                embedding_size=8, hidden_sizes=[8, 16, 32, 64],
                depths=[1, 1, 1, 1] if smoke else [3, 4, 6, 3], num_labels=10))
        pixels = torch.randn(2, 3, 32, 32, generator=g)
        return model, {"pixel_values": pixels}, torch.randint(0, 10, (2,), generator=g)
    vocab = 1000
    if name == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(
            **width, num_hidden_layers=1 if smoke else 12, vocab_size=vocab,
            max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0))
    elif name == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(
            n_embd=32, n_layer=1 if smoke else 12, n_head=2, vocab_size=vocab, n_positions=64,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    elif name == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=1 if smoke else 8, vocab_size=vocab, max_position_embeddings=64))
    else:
        raise ValueError(f"unknown model {name!r}; pick from {', '.join(MODELS)}")
    ids = torch.randint(1, vocab, (2, 16), generator=g)
    labels = ids if name != "bert" else torch.randint(0, 2, (2,), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, labels


def cross_entropy(out: Any, labels: torch.Tensor) -> torch.Tensor:
    """The user's loss: cross-entropy on the logits in fp32 (next-token for 3-D logits)."""
    logits = (out if isinstance(out, torch.Tensor) else out.logits).float()
    if logits.dim() == 3:
        return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
    return nn.functional.cross_entropy(logits, labels)


class Step:
    """One mode's train step on its own copy of the model (see the module docstring)."""

    def __init__(self, mode: str, model: nn.Module, inputs: dict, labels: torch.Tensor):
        self.mode = mode
        self.model = copy.deepcopy(model).train()
        self.inputs = inputs
        self.labels = labels
        if mode == "floor":
            self.model.to(torch.bfloat16)
            self.inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
                           for k, v in inputs.items()}
        self.net: Callable = self.model
        if mode == "O2":
            self.net = ampgraph.compile(self.model, "O2", "bf16", runtime="cuda")
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=False,
                                     foreach=True)

    def __call__(self, counter: KernelCounter | None = None) -> None:
        counter = counter or KernelCounter()  # a throwaway one keeps the phases simple
        counter.phase = "fwd"
        if self.mode == "autocast":
            with torch.autocast("cpu", torch.bfloat16):
                out = self.net(**self.inputs)
        else:
            out = self.net(**self.inputs)
        loss = cross_entropy(out, self.labels)
        counter.phase = "bwd"
        loss.backward()
        counter.phase = "opt"
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def count_step(step: Step, warmup: int = 2) -> KernelCounter:
    """Run ``warmup`` steps, then count one."""
    for _ in range(warmup):
        step()
    counter = KernelCounter()
    with counter:
        step(counter)
    return counter


def measure(name: str, smoke: bool, modes: tuple[str, ...] = MODES) -> dict[str, KernelCounter]:
    model, inputs, labels = build(name, smoke)
    return {mode: count_step(Step(mode, model, inputs, labels)) for mode in modes}


def summary(counts: dict[str, KernelCounter]) -> dict[str, Any]:
    """Totals per mode, and O2 against the floor when both ran."""
    entry: dict[str, Any] = {mode: c.totals() for mode, c in counts.items()}
    if "O2" in entry and "floor" in entry:
        o2, floor = entry["O2"], entry["floor"]
        entry["O2/floor"] = round(o2["kernels"] / floor["kernels"], 3)
        entry["O2-floor casts"] = o2["casts"] - floor["casts"]
    return entry


def print_table(name: str, entry: dict[str, Any]) -> None:
    print(f"\n{name}: per train step")
    print(f"{'mode':10}{'kernels':>9}{'casts':>7}{'allocs':>8}{'syncs':>7}")
    for mode in MODES:
        if mode in entry:
            t = entry[mode]
            print(f"{mode:10}{t['kernels']:9d}{t['casts']:7d}{t['allocs']:8d}{t['syncs']:7d}")
    if "O2/floor" in entry:
        print(f"O2/floor kernels {entry['O2/floor']:.3f}; O2 - floor casts "
              f"{entry['O2-floor casts']:+d}")


def print_diff(counts: dict[str, KernelCounter]) -> None:
    """The ops O2 launches more (+) or fewer (-) times than the floor, and the casts."""
    o2, floor = counts["O2"], counts["floor"]
    for label, a, b in (("kernels", o2.kernels, floor.kernels), ("casts", o2.casts, floor.casts)):
        diff = {op: a[op] - b[op] for op in set(a) | set(b) if a[op] != b[op]}
        items = sorted(diff.items(), key=lambda kv: -abs(kv[1]))
        print(f"  O2 - floor {label}: " + ", ".join(f"{op} {d:+d}" for op, d in items))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--smoke", action="store_true", help="one layer per model")
    p.add_argument("--diff", action="store_true", help="print O2's ops against the floor's")
    p.add_argument("--json", help="write the totals here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # the counts do not depend on it; the run shares the machine
    modes = tuple(args.modes.split(","))
    results = {}
    for name in args.models.split(","):
        counts = measure(name, args.smoke, modes)
        results[name] = summary(counts)
        print_table(name, results[name])
        if args.diff and "O2" in counts and "floor" in counts:
            print_diff(counts)
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"torch": torch.__version__, "smoke": args.smoke, "models": results}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
