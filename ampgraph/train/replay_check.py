"""ReplayCheck: a stand-in for CUDA graphs, on any device, that checks a step could be captured.

:class:`~ampgraph.train.graphs.StepGraphs` hands an engine a phase function and its static
inputs. Every engine offers ``warmup`` (run it as an ordinary call), ``capture`` (record
it, run it once for the call that asked, and return its outputs) and ``replay`` (run the
record again; the outputs are the same tensors, written again). The CUDA one is
``ampgraph.runtime.cuda.graphs.CudaGraphEngine``.

:class:`ReplayCheck` makes no graph: it runs the function again at each replay under a
dispatch mode and checks what a CUDA graph relies on: no host synchronisation, the same
aten ops in the same order, and every tensor made before the run (parameters, gradients,
working copies, optimizer state, the loss scale, the static inputs) read and written at
the address it had at capture. A graph replays the addresses it recorded, so a step that
moved one would read stale memory on a GPU; on the CPU this check finds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["CaptureMismatch", "ReplayCheck", "SYNC_OPS"]

# aten ops that wait for the device: a value read on the host, or an output whose size
# depends on the data
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "nonzero", "equal", "masked_select",
    "_unique", "_unique2", "unique_consecutive", "unique_dim", "nonzero_static",
})


class CaptureMismatch(RuntimeError):
    """A step that a CUDA graph would not replay faithfully (raised by :class:`ReplayCheck`)."""


class ReplayCheck:
    """A stand-in for ``CudaGraphEngine`` on any device that checks a step could be
    captured; see the module docstring. Slow (every op goes through a dispatch mode): for
    tests and for checking a step on a machine without a GPU.

    Example:
        >>> handle, out = ReplayCheck().capture(fn, (x,), {}, prepare=lambda: None)  # +SKIP
    """

    def warmup(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return fn(*args, **kwargs)

    def capture(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
                prepare: Callable[[], None]) -> tuple[Any, Any]:
        prepare()
        trace = _Trace()
        with trace:
            out = fn(*args, **kwargs)
        trace.check_syncs("capture")
        return _Recorded(fn, args, kwargs, prepare, trace.ops), out

    def replay(self, handle: _Recorded, out: Any) -> Any:
        handle.prepare()  # what the graph recorded after it runs again on every replay
        trace = _Trace()
        with trace:
            new = handle.fn(*handle.args, **handle.kwargs)
        trace.check_syncs(f"replay {handle.replays + 1}")
        handle.compare(trace.ops)
        with torch.no_grad():  # a graph writes its outputs where it recorded them
            for static, fresh in zip(_tensors(out), _tensors(new)):
                static.copy_(fresh)
        return out


class _Recorded:
    def __init__(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
                 prepare: Callable[[], None], ops: list[tuple]) -> None:
        self.fn, self.args, self.kwargs, self.prepare, self.ops = fn, args, kwargs, prepare, ops
        self.replays = 0

    def compare(self, ops: list[tuple]) -> None:
        self.replays += 1
        for i, (then, now) in enumerate(zip(self.ops, ops)):
            if then[0] != now[0]:
                raise CaptureMismatch(
                    f"replay {self.replays} ran aten.{now[0]} where the capture ran "
                    f"aten.{then[0]} (op {i}): the step's Python took another branch, which "
                    "a CUDA graph would not; the graph replays what it captured")
            if then[1] != now[1]:
                raise CaptureMismatch(
                    f"replay {self.replays}: aten.{now[0]} (op {i}) read or wrote a tensor made "
                    "before the step at another address than at capture "
                    f"({_moved(then[1], now[1])}); a CUDA graph would use the old memory: "
                    "keep what the step reads between steps in place")
        if len(ops) != len(self.ops):
            raise CaptureMismatch(
                f"replay {self.replays} ran {len(ops)} aten ops where the capture ran "
                f"{len(self.ops)}: the step's Python took another branch")


def _moved(then: tuple, now: tuple) -> str:
    for (slot, a), (_, b) in zip(then, now):
        if a != b:
            return f"argument {slot}: {a:#x} then, {b:#x} now"
    return f"{len(then)} tensors then, {len(now)} now"


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


class _Trace(TorchDispatchMode):
    """Every aten op of a run with the storages it touched that were made before the run
    (a storage first seen as an op's output was made in the run: a graph's own memory)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, tuple]] = []
        self.syncs: list[str] = []
        self._made: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            self.syncs.append(name)
        before = []
        for slot, t in enumerate(tree_flatten((args, kwargs))[0]):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                ptr = t.untyped_storage().data_ptr()
                if ptr and ptr not in self._made:
                    before.append((slot, ptr))
        out = func(*args, **kwargs)
        seen = {p for _, p in before}
        for t in _tensors(out):
            ptr = t.untyped_storage().data_ptr()
            if ptr not in seen:
                self._made.add(ptr)
        self.ops.append((name, tuple(before)))
        return out

    def check_syncs(self, when: str) -> None:
        if self.syncs:
            raise CaptureMismatch(
                f"the step synchronises with the device ({', '.join(sorted(set(self.syncs)))} "
                f"at {when}): a CUDA graph cannot capture a value read on the host; keep "
                "decisions on the device (a fused optimizer taking found_inf)")
