"""``ampgraph bench``: step time and peak memory of fp32 eager, torch.autocast and ampgraph
levels, measured in one process, interleaved (one step of each variant in turn), after
warm-up.

Peak memory is measured in one extra, untimed step per variant:

- CUDA: ``torch.cuda.max_memory_allocated()`` during the step minus the memory allocated
  before it;
- CPU: the peak of live tensor storage allocated by operators during the step, tracked by
  a ``TorchDispatchMode`` with a finalizer on each new storage (memory alive before the
  step, such as the fp32 weights, is not counted). Process RSS would mostly measure the
  allocator, and tracemalloc does not see torch's allocations.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ampgraph.cli.target import one_line, quiet

MEMORY_METHOD = {
    "cuda": "torch.cuda.max_memory_allocated during one step, minus memory allocated before",
    "cpu": "peak live tensor storage allocated by operators during one step "
           "(TorchDispatchMode + storage finalizers)",
}


@dataclass
class Variant:
    """One way of running the model."""

    name: str
    kind: str  # "fp32" | "autocast" | "ampgraph"
    level: str | None
    module: nn.Module
    context: Callable[[], Any]
    optimizer: Any = None
    times: list[float] = field(default_factory=list)
    peak: int | None = None
    error: str | None = None


class _StoragePeak(TorchDispatchMode):
    """Tracks live bytes of storages created by operators while active."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._ids: set[int] = set()

    def _free(self, key: int, size: int) -> None:
        self._ids.discard(key)
        self.live -= size

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and _has_storage(t)}
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or not _has_storage(t):
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in inputs or key in self._ids:
                continue
            size = storage.nbytes()
            self._ids.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out


def _has_storage(t: torch.Tensor) -> bool:
    return t.layout == torch.strided and t.device.type != "meta"


def _loss(out: Any) -> torch.Tensor:
    floats = [t for t in tree_flatten(out)[0]
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise ValueError("the model returned no floating-point tensor to back-propagate")
    return sum(t.float().pow(2).mean() for t in floats)


def make_variants(model: nn.Module, levels: list[str], low: torch.dtype, device: torch.device,
                  train: bool) -> list[Variant]:
    """fp32 eager, torch.autocast and one ampgraph module per level (independent copies)."""
    import ampgraph

    out = [Variant("fp32", "fp32", None, copy.deepcopy(model), contextlib.nullcontext),
           Variant(f"autocast {_short(low)}", "autocast", None, copy.deepcopy(model),
                   lambda: torch.autocast(device.type, dtype=low))]
    for level in levels:
        net = ampgraph.compile(copy.deepcopy(model), amp_level=level, dtype=low)
        out.append(Variant(f"ampgraph {level}", "ampgraph", level, net, contextlib.nullcontext))
    for v in out:
        v.module.train(train)
        if train:
            v.optimizer = torch.optim.SGD(v.module.parameters(), lr=1e-4)
    return out


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))


def _step(v: Variant, inputs: tuple, train: bool, device: torch.device) -> None:
    if train:
        v.optimizer.zero_grad(set_to_none=True)
        with v.context():
            out = v.module(*inputs)
        _loss(out).backward()
        v.optimizer.step()
    else:
        with torch.no_grad(), v.context():
            v.module(*inputs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak(v: Variant, inputs: tuple, train: bool, device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        _step(v, inputs, train, device)
        return int(torch.cuda.max_memory_allocated(device) - base)
    with _StoragePeak() as tracker:
        _step(v, inputs, train, device)
    return tracker.peak


def run(model: nn.Module, inputs: tuple, levels: list[str], low: torch.dtype,
        device: torch.device, steps: int, warmup: int, train: bool,
        hide_capture_output: bool = True) -> list[Variant]:
    """Warm up, time ``steps`` interleaved steps of every variant, then measure peak memory.

    Example:
        >>> variants = run(model, (x,), ["O1", "O2"], torch.bfloat16, torch.device("cpu"),
        ...                steps=20, warmup=3, train=False)
    """
    from tqdm.auto import tqdm

    variants = make_variants(model, levels, low, device, train)
    warm = {v.name: max(warmup, 1 if v.kind == "ampgraph" else 0) for v in variants}
    bar = tqdm(total=sum(warm.values()) + len(variants) * (steps + 1), desc="ampgraph bench",
               unit="step", file=sys.stderr, disable=not sys.stderr.isatty(), leave=False)
    try:
        for v in variants:
            for _ in range(warm[v.name]):  # ampgraph's first call captures: never timed
                try:
                    with quiet(hide_capture_output):
                        _step(v, inputs, train, device)
                except Exception as exc:  # report the variant as failed, bench the rest
                    v.error = one_line(exc)
                    break
                bar.update(1)
        live = [v for v in variants if v.error is None]
        for _ in range(steps):
            for v in live:
                t0 = time.perf_counter()
                _step(v, inputs, train, device)
                v.times.append(time.perf_counter() - t0)
                bar.update(1)
        for v in live:
            v.peak = _peak(v, inputs, train, device)
            bar.update(1)
    finally:
        bar.close()
    return variants


def results(variants: list[Variant]) -> list[dict[str, Any]]:
    """One JSON record per variant (times in milliseconds)."""
    base = next((statistics.median(v.times) for v in variants if v.kind == "fp32" and v.times),
                None)
    out = []
    for v in variants:
        rec: dict[str, Any] = {"name": v.name, "kind": v.kind, "level": v.level}
        if v.error is not None:
            rec["error"] = v.error
        else:
            med = statistics.median(v.times)
            rec.update(median_ms=round(1e3 * med, 4), min_ms=round(1e3 * min(v.times), 4),
                       max_ms=round(1e3 * max(v.times), 4),
                       speedup=round(base / med, 3) if base and med else None,
                       peak_bytes=v.peak)
        out.append(rec)
    return out


def table(records: list[dict[str, Any]]) -> str:
    from ampgraph.cli.render import human_bytes

    head = f"{'variant':<16}{'median ms':>11}{'min ms':>10}{'max ms':>10}{'vs fp32':>9}" \
           f"{'peak memory':>14}"
    lines = [head, "-" * len(head)]
    for r in records:
        if "error" in r:
            lines.append(f"{r['name']:<16}  failed: {r['error']}")
            continue
        speed = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        lines.append(f"{r['name']:<16}{r['median_ms']:>11.3f}{r['min_ms']:>10.3f}"
                     f"{r['max_ms']:>10.3f}{speed:>9}{human_bytes(r['peak_bytes']):>14}")
    return "\n".join(lines)
