"""Host time of the CUDA runtime's weight groups per train step, measured on the CPU.

On a GPU the eager step is launch-bound: what the host spends in ampgraph's own Python is
time the GPU waits. This harness compiles HF BERT-base's depth and parameter structure (12
layers, ~200 parameters in groups) at tiny width with ``runtime="cuda"`` on CPU tensors,
so the kernels are negligible and what is left is host work, and trains it with the
user's loop (forward, fp32 cross-entropy, backward, foreach AdamW, ``zero_grad``).

It times the runtime's entry points, inclusive: ``WeightGroup.low_copies`` (forward: the
key check, the refresh, the autograd node, the views handed out) and ``_GroupCast.backward``
(the gradients returned to the masters), each wrapped with ``thread_time`` (CPU time: the
machine may be busy), and the whole step beside them. The groups' ``_foreach_copy_`` calls
are timed apart: on the CPU they copy tensor by tensor where a GPU takes one launch, so
the groups' host work is the rest. Medians over ``--steps`` steps after ``--warmup``. Also
counts the
allocations (``empty``/``empty_strided``) and multi-tensor copies the groups make per step.

    python benchmarks/group_host_time.py               # BERT-base depth, hidden 64
    python benchmarks/group_host_time.py --hidden 768  # BERT-base itself: 7 groups
    python benchmarks/group_host_time.py --smoke       # 2 layers: a harness check
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

import ampgraph  # noqa: E402
from ampgraph.runtime.cuda import master_weights  # noqa: E402


class _Timer:
    """Inclusive CPU time of this thread in wrapped functions, per step (on a shared
    machine, time spent descheduled is not the runtime's)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[name] = self.seconds.get(name, 0.0) + time.thread_time() - t0
        return timed


class _TorchWithTimedCopies:
    """``torch`` as the runtime module sees it, its ``_foreach_copy_`` timed."""

    def __init__(self, timer: _Timer) -> None:
        self._foreach_copy_ = timer.wrap("copies", torch._foreach_copy_)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


class _Allocations(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in ("empty", "empty_strided", "empty_like", "_foreach_copy_"):
            self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def build(smoke: bool, hidden: int = 64) -> tuple[torch.nn.Module, dict, torch.Tensor]:
    import transformers as tf

    torch.manual_seed(0)
    config = tf.BertConfig(hidden_size=hidden, num_hidden_layers=2 if smoke else 12,
                           num_attention_heads=2 if hidden < 256 else 12,
                           intermediate_size=4 * hidden,
                           vocab_size=1000 if hidden < 256 else 30522)
    model = tf.BertForSequenceClassification(config)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, config.vocab_size, (8, 32), generator=g)
    return model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, \
        torch.randint(0, 2, (8,), generator=g)


def measure(steps: int, warmup: int, smoke: bool, hidden: int = 64) -> dict[str, Any]:
    model, inputs, labels = build(smoke, hidden)
    net = ampgraph.compile(model, "O2", "bf16", runtime="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    timer = _Timer()
    group_cls, cast_cls = master_weights.WeightGroup, master_weights._GroupCast
    originals = group_cls.low_copies, cast_cls.backward
    group_cls.low_copies = timer.wrap("forward", group_cls.low_copies)
    cast_cls.backward = staticmethod(timer.wrap("backward", cast_cls.backward))
    # the groups' multi-tensor copies run element by element on the CPU: a launch on a GPU
    master_weights.torch = _TorchWithTimedCopies(timer)

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(net(**inputs).logits.float(), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    rows: dict[str, list[float]] = {"forward": [], "backward": [], "step": [], "copies": []}
    try:
        for i in range(warmup + steps):
            timer.seconds.clear()
            t0 = time.thread_time()
            step()
            total = time.thread_time() - t0
            if i >= warmup:
                rows["step"].append(total * 1e3)
                for k in ("forward", "backward", "copies"):
                    rows[k].append(timer.seconds.get(k, 0.0) * 1e3)
        allocations = _Allocations()
        with allocations:
            step()
    finally:
        group_cls.low_copies, cast_cls.backward = originals
        master_weights.torch = torch
    groups = len(net._amp_runtime.groups())
    params = sum(1 for _ in model.parameters())
    result = {k: statistics.median(v) for k, v in rows.items()}
    result["groups_ms"] = result["forward"] + result["backward"]
    result["host_ms"] = result["groups_ms"] - result["copies"]
    result.update(groups=groups, parameters=params, **allocations.counts)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--hidden", type=int, default=64,
                        help="768: BERT-base's own width (7 groups, slow copies on a CPU)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # host work: one thread, less noise from the other core
    r = measure(3 if args.smoke else args.steps, 1 if args.smoke else args.warmup, args.smoke,
                args.hidden)
    print(f"{r['parameters']} parameters in {r['groups']} groups; median ms per step:")
    print(f"  groups' forward  {r['forward']:8.3f}")
    print(f"  groups' backward {r['backward']:8.3f}")
    print(f"  groups in all    {r['groups_ms']:8.3f}  of a {r['step']:.1f} ms step")
    print(f"  of which the multi-tensor copies' CPU work {r['copies']:8.3f} (a launch each on a "
          f"GPU); the rest, host work: {r['host_ms']:.3f}")
    print(f"  allocations: {r.get('empty_strided', 0)} empty_strided, {r.get('empty', 0)} "
          f"empty; {r.get('_foreach_copy_', 0)} _foreach_copy_")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
