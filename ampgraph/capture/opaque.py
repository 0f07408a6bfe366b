"""Calls kept out of a captured graph: the user's code runs there as written, every call.

torch.export traces through a user's ``torch.autograd.Function`` (its ``backward`` is lost:
a straight-through estimator's gradient becomes 0) and through a submodule's hooks (they
run once, on fake tensors). Such a call is made one opaque node instead:

- while export traces, the call becomes ``ampgraph::opaque(key, tensors, sizes)``, a custom
  op whose fake kernel runs the call's own forward on the fake inputs to learn its outputs
  (:func:`emit`; the watch is paused meanwhile, so nothing inside is routed again);
- the AMP passes see one op, kept fp32 (``passes/fx/policy.py``: its inputs are cast to
  fp32, as the user's fp32 model gave them);
- once the passes are done, :func:`bind_opaque_calls` makes each such node call its
  :class:`OpaqueCall` directly, a Python call under autograd: the user's ``Function.apply``
  with its own backward, or the submodule through ``nn.Module.__call__`` with its hooks.

An :class:`OpaqueCall` takes its inputs as the op does: the tensors, the symbolic sizes,
and the rest of the arguments (constants, kept in the call) rebuilt around them; its
outputs as the fake run gave them (tensors only; constants must come back equal).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from ampgraph.capture.watch import active, paused

_REGISTRY: dict[int, OpaqueCall] = {}  # key -> call, from emit() to bind_opaque_calls()
_keys = itertools.count()
_lock = threading.Lock()
OPAQUE_KEY = "ampgraph.opaque"  # the op's policy key


class UnsupportedOpaque(TypeError):
    """A call that cannot be kept out of the graph (an argument or result that is neither a
    tensor, a size nor a constant): the module making it runs eagerly instead."""


class OpaqueCall:
    """One call kept out of the graph; see the module docstring. Subclasses say what runs
    (:meth:`run`), on real tensors under autograd and, for the fake kernel, on fake ones
    (:meth:`run_fake`)."""

    kind = "call"

    def __init__(self, name: str, args: tuple, kwargs: dict) -> None:
        self.name = name  # what explain shows: "STE.apply", "encoder.layer.3"
        leaves, self.in_spec = pytree.tree_flatten((args, kwargs))
        self.in_slots: list[tuple[str, Any]] = []  # per leaf: ("T", i), ("S", i) or ("C", value)
        tensors, sizes = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                self.in_slots.append(("T", len(tensors)))
                tensors.append(leaf)
            elif isinstance(leaf, torch.SymInt):
                self.in_slots.append(("S", len(sizes)))
                sizes.append(leaf)
            elif isinstance(leaf, (torch.SymFloat, torch.SymBool)):
                raise UnsupportedOpaque(f"{name} takes a symbolic {type(leaf).__name__}")
            else:
                self.in_slots.append(("C", leaf))
        self.tensors, self.sizes = tensors, sizes
        self.out_spec: Any = None  # from the fake run
        self.out_slots: list[tuple[str, Any]] = []

    # -- what runs --------------------------------------------------------------------------

    def prepare(self, compile_module: Callable[[Any, str], Any], prefix: str) -> None:
        """Before the graph is bound: a call that runs a module gets its compiled module
        (``compile_module(module, path)``, ``prefix`` the graph's module path)."""

    def run(self, args: tuple, kwargs: dict) -> Any:
        raise NotImplementedError

    def run_fake(self, args: tuple, kwargs: dict) -> Any:
        return self.run(args, kwargs)

    # -- the op's calling convention --------------------------------------------------------

    def inputs(self, tensors: list[torch.Tensor], sizes: list[int]) -> tuple[tuple, dict]:
        leaves = [tensors[i] if tag == "T" else sizes[i] if tag == "S" else i
                  for tag, i in self.in_slots]
        return pytree.tree_unflatten(leaves, self.in_spec)

    def fake(self, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        """The fake kernel: the call's forward on fake inputs; its tensor outputs, cloned
        (an op's outputs may not alias its inputs)."""
        args, kwargs = self.inputs(tensors, sizes)
        fake_mode = detect_fake_mode(tensors)
        shape_env = getattr(fake_mode, "shape_env", None)
        with paused(active()), (shape_env.ignore_fresh_unbacked_symbols() if shape_env
                                is not None else contextlib.nullcontext()):
            out = self.run_fake(args, kwargs)  # values it reads from data stay inside
        leaves, spec = pytree.tree_flatten(out)
        slots, flat = [], []
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                sizes_known = tuple(s if isinstance(s, int) else None for s in leaf.shape)
                slots.append(("T", (leaf.dtype, sizes_known)))
                flat.append(leaf.clone())
            elif isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise UnsupportedOpaque(f"{self.name} returns a symbolic "
                                        f"{type(leaf).__name__}")
            else:
                slots.append(("C", leaf))
        if self.out_spec is None:
            self.out_spec, self.out_slots = spec, slots
        return flat

    def outputs(self, flat: list[torch.Tensor]) -> Any:
        """The call's result rebuilt from the op's tensor outputs."""
        it = iter(flat)
        leaves = [next(it) if tag == "T" else v for tag, v in self.out_slots]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def __call__(self, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
        """What the bound graph calls: the user's code on real tensors, under autograd. Its
        result must have the structure, dtypes and static sizes the graph was traced with."""
        args, kwargs = self.inputs(tensors, sizes)
        leaves, spec = pytree.tree_flatten(self.run(args, kwargs))
        out = []
        if spec == self.out_spec and len(leaves) == len(self.out_slots):
            for leaf, (tag, want) in zip(leaves, self.out_slots):
                if tag != "T":
                    continue
                if not isinstance(leaf, torch.Tensor) or not _fits(leaf, *want):
                    break
                out.append(leaf)
            else:
                return out
        raise RuntimeError(
            f"ampgraph: {self.name} returned {_summary(leaves, spec)} where the graph was "
            f"captured with {_summary_slots(self.out_slots, self.out_spec)}; capture the "
            "model again (net.drop_graphs()) after changing what it returns")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"


def _fits(t: torch.Tensor, dtype: torch.dtype, sizes: tuple) -> bool:
    return t.dtype == dtype and t.dim() == len(sizes) and all(
        want is None or got == want for got, want in zip(t.shape, sizes))


def _summary(leaves: list, spec: Any) -> str:
    parts = [f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}"
             if isinstance(v, torch.Tensor) else repr(v) for v in leaves]
    return f"{spec.type.__name__ if spec.type else 'a value'} of ({', '.join(parts)})"


def _summary_slots(slots: list, spec: Any) -> str:
    parts = [f"{str(v[0]).removeprefix('torch.')}{['?' if s is None else s for s in v[1]]}"
             if tag == "T" else repr(v) for tag, v in slots]
    return f"{spec.type.__name__ if spec.type else 'a value'} of ({', '.join(parts)})"


@torch.library.custom_op("ampgraph::opaque", mutates_args=())
def opaque(key: int, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    """Unbound graphs only (the bound ones call the :class:`OpaqueCall` itself): the call
    below autograd, for a graph run without gradients (calibration)."""
    return [t.clone() for t in _REGISTRY[key](tensors, sizes)]


@opaque.register_fake
def _opaque_fake(key: int, tensors: list[torch.Tensor], sizes: list[int]) -> list[torch.Tensor]:
    return _REGISTRY[key].fake(tensors, sizes)


def emit(call: OpaqueCall) -> Any:
    """Record ``call`` in the graph being traced as one opaque op; its result (fake
    tensors, in the call's own structure). Keys live until :func:`bind_opaque_calls` or
    :func:`release`."""
    with _lock:
        key = next(_keys)
        _REGISTRY[key] = call
    watch = active()
    if watch is not None:
        watch.emitted.append(key)  # released by export_module should the export fail
    flat = torch.ops.ampgraph.opaque.default(key, call.tensors, call.sizes)
    call.tensors = call.sizes = None  # the fake inputs are the graph's now
    return call.outputs(flat)


def opaque_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The graph's unbound opaque calls."""
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.ampgraph.opaque.default]


def describe_opaque_nodes(gm: fx.GraphModule) -> None:
    """Note on each opaque node what it calls (``meta["amp_orig_op"]``: explain's op)."""
    for node in opaque_nodes(gm):
        call = _REGISTRY.get(node.args[0])
        if call is not None:  # what explain shows as its op
            node.meta["amp_orig_op"] = f"{call.kind}: {call.name}"


def bind_opaque_calls(gm: fx.GraphModule,
                      prepare: Callable[[OpaqueCall], None] | None = None) -> list[OpaqueCall]:
    """Make each opaque node of ``gm`` call its :class:`OpaqueCall` (``prepare`` sees each
    first: a module call gets its runner there) and release the keys. The calls bound."""
    bound = []
    for node in opaque_nodes(gm):
        call = _REGISTRY.pop(node.args[0], None)
        if call is None:
            raise RuntimeError(f"ampgraph: opaque call {node.args[0]} was released unbound")
        if prepare is not None:
            prepare(call)
        call.__name__ = call.__qualname__ = f"opaque_{node.args[0]}"  # FX writes it by name
        call.__module__ = __name__
        node.target = call
        node.args = node.args[1:]
        bound.append(call)
    if bound:
        gm.recompile()
    return bound


def release(keys: Any = None) -> None:
    """Forget the calls of a capture that failed (``keys``: all when None)."""
    with _lock:
        for key in list(_REGISTRY) if keys is None else keys:
            _REGISTRY.pop(key, None)


def registered() -> set[int]:
    """The keys registered now (to release those a failed capture added)."""
    return set(_REGISTRY)
