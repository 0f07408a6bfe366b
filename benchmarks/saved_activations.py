"""Bytes autograd saves for backward in one training forward, with and without activation
checkpointing: eager fp32, eager bf16 (``model.to(torch.bfloat16)``) and ampgraph O2 bf16.

The model: HuggingFace ``LlamaForCausalLM(LlamaConfig(hidden_size=256,
num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=688,
vocab_size=32000))`` built from its config (random weights, nothing downloaded), a batch
of 4 x 256 tokens; checkpointing is ``model.gradient_checkpointing_enable()`` (non-reentrant,
transformers' default). ``--smoke``: a 2-layer d=64 model, 2 x 32 tokens.

What is counted (the same way for every mode):

- every tensor autograd saves during ``model(input_ids)`` (an outer
  ``torch.autograd.graph.saved_tensors_hooks`` pack hook), plus every tensor a
  non-reentrant checkpoint call receives (its arguments, and those bound into a
  ``functools.partial`` it is given, as HuggingFace's layers pass theirs): the checkpoint
  keeps them alive for recomputation, and its own pack hooks, innermost, hide what is
  saved inside its region from the outer hook (dropped there, recomputed in backward);
- each storage once (views, and the same tensor saved twice, count once), at its whole
  size (``untyped_storage().nbytes()``);
- not the storages alive before the forward starts: the model's parameters and buffers,
  the input ids, and the runtime's persistent low-precision weight copies and kept
  buffers (O2's CPU runtime keeps a linear's working copy between steps; it exists without
  training too, as its inference copy). A first training step runs before the measured
  one so those exist, for every mode alike. Their bytes that autograd does save are shown
  apart ("persistent saved"), not added.

The loss (cross-entropy of the next token, in fp32) is computed outside the measured call.
The last column compares O2's gradients with checkpointing to O2's without, after one step
from the same weights on the same batch: the largest absolute difference over the largest
absolute gradient, per parameter, the worst parameter.

Run: ``python benchmarks/saved_activations.py [--smoke]``.
"""

from __future__ import annotations

import argparse
import copy
import functools
import gc
import sys
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ampgraph  # noqa: E402

MIB = 1 << 20


def live_storages() -> set[int]:
    """Data pointers of every tensor's storage alive now (parameters, buffers, kept copies)."""
    gc.collect()
    ptrs = set()
    with warnings.catch_warnings():  # isinstance on some objects warns (deprecated names)
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
                    ptrs.add(obj.untyped_storage().data_ptr())
            except Exception:  # a tensor subclass without storage
                continue
    return ptrs


@contextmanager
def counting_checkpoint_inputs(count: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """Count the tensors each non-reentrant checkpoint call receives (see the docstring)."""
    original = torch_checkpoint._checkpoint_without_reentrant_generator

    def counting(fn, preserve, context_fn, determinism_check, debug, early_stop, *args,
                 **kwargs):
        bound = (fn.args, fn.keywords) if isinstance(fn, functools.partial) else ()
        for leaf in tree_leaves((args, kwargs, bound)):
            if isinstance(leaf, torch.Tensor):
                count(leaf)
        return original(fn, preserve, context_fn, determinism_check, debug, early_stop,
                        *args, **kwargs)

    torch_checkpoint._checkpoint_without_reentrant_generator = counting
    try:
        yield
    finally:
        torch_checkpoint._checkpoint_without_reentrant_generator = original


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """(counted bytes, bytes of persistent storages saved, logits) of one forward."""
    persistent = live_storages()
    counted: dict[int, int] = {}
    kept: dict[int, int] = {}

    def count(t: torch.Tensor) -> None:
        if t.layout != torch.strided or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr == 0:
            return
        (kept if ptr in persistent else counted)[ptr] = storage.nbytes()

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            counting_checkpoint_inputs(count):
        logits = model(ids).logits
    return sum(counted.values()), sum(kept.values()), logits


def loss_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                           ids[:, 1:].reshape(-1))


def measure(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, int, list[torch.Tensor]]:
    """Warm-up step, then the measured step: (counted, persistent saved, gradients)."""
    model.train()
    loss_of(model(ids).logits, ids).backward()  # the runtime's kept copies now exist
    model.zero_grad(set_to_none=True)
    counted, kept, logits = saved_bytes(model, ids)
    loss_of(logits, ids).backward()
    grads = [p.grad.detach().float().clone() for p in model.parameters()]
    return counted, kept, grads


def make_model(smoke: bool) -> torch.nn.Module:
    import transformers as tf
    size = (dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128, vocab_size=512) if smoke else
            dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=688, vocab_size=32000))
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**size, use_cache=False))


def grad_error(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
               for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny model, seconds")
    opts = parser.parse_args(argv)
    torch.manual_seed(0)
    base = make_model(opts.smoke)
    batch, seq = (2, 32) if opts.smoke else (4, 256)
    ids = torch.randint(1, base.config.vocab_size, (batch, seq),
                        generator=torch.Generator().manual_seed(1))
    modes = {
        "eager fp32": lambda m: m,
        "eager bf16": lambda m: m.to(torch.bfloat16),
        "ampgraph O2": lambda m: ampgraph.compile(m, amp_level="O2", dtype="bf16"),
    }
    results: dict[str, dict[str, float]] = {}
    grads: dict[tuple[str, bool], list[torch.Tensor]] = {}
    print("| mode | without checkpointing | with gradient_checkpointing_enable() "
          "| parameters and persistent copies saved (excluded), with | O2 grads vs O2 without |")
    print("|---|---|---|---|---|")
    for name, make in modes.items():
        row = {}
        for ckpt in (False, True):
            model = copy.deepcopy(base)
            if ckpt:
                model.gradient_checkpointing_enable()
            counted, kept, grads[name, ckpt] = measure(make(model), ids)
            row["with" if ckpt else "without"] = counted / MIB
            row["persistent_with" if ckpt else "persistent_without"] = kept / MIB
            del model
        err = grad_error(grads[name, True], grads[name, False])
        row["grad_error"] = err
        results[name] = row
        print(f"| {name} | {row['without']:.2f} MiB | {row['with']:.2f} MiB "
              f"| {row['persistent_with']:.2f} MiB | {err:.2e} |")
    ratio = results["ampgraph O2"]["with"] / results["eager bf16"]["with"]
    print(f"\nO2 with checkpointing / eager bf16 with checkpointing: {ratio:.2f}x")
    return results


if __name__ == "__main__":
    main()
