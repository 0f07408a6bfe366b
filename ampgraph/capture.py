"""Capture a module with torch.export and keep one graph per (mode, input structure).

The exported root takes ``(args, kwargs)`` as two inputs and returns a flat tuple, so any
forward signature and any output structure (dicts, dataclasses, HuggingFace
``ModelOutput``) work; :class:`OutputSpec` rebuilds the user's structure.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import io
import logging
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_flatten, tree_map

# ---------------------------------------------------------------------------- global state

_AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def preserved_global_state(rng: bool = True) -> Iterator[None]:
    """Leave the process as the body found it, whether the body returns or raises.

    A capture attempt runs the user's forward under torch.export's tracer and re-runs ops
    in the AMP passes; either can leave thread-local state behind (torch 2.13's
    ``wrap_with_set_grad_enabled`` higher-order op, re-run on a submodule that cannot be
    called, raises with grad mode still off). Restored here: grad mode, forward-mode AD,
    inference mode (the autograd and dispatch-key thread-local state, through an
    ``InferenceMode`` guard entered in the state it found), autocast for CPU and CUDA
    (enabled, dtype, weight cache, nesting), the default dtype, torch function and
    dispatch mode stacks, and with ``rng`` the CPU, initialised CUDA and Python RNG states
    (tracing must not consume the numbers the real forward draws).
    """
    grad = torch.is_grad_enabled()
    fwd_grad = torch._C._is_fwd_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    default_dtype = torch.get_default_dtype()
    autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                for d in _AUTOCAST_DEVICES}
    autocast_cache = torch.is_autocast_cache_enabled()
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    function_modes = torch._C._len_torch_function_stack()
    dispatch_modes = torch._C._len_torch_dispatch_stack()
    if rng:
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        py_rng = random.getstate()
    # Its destructor puts back the autograd state and dispatch keys it found; entering it
    # in the current inference mode changes grad modes only, and those are set back now.
    guard = torch._C._InferenceMode(inference)
    torch._C._set_grad_enabled(grad)
    torch._C._set_fwd_grad_enabled(fwd_grad)
    try:
        yield
    finally:
        while torch._C._len_torch_function_stack() > function_modes:
            torch._C._pop_torch_function_stack()
        while torch._C._len_torch_dispatch_stack() > dispatch_modes:
            torch._C._pop_torch_dispatch_stack()
        del guard
        torch._C._set_grad_enabled(grad)
        torch._C._set_fwd_grad_enabled(fwd_grad)
        torch.set_default_dtype(default_dtype)
        for device, (enabled, dtype) in autocast.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(autocast_cache)
        now = torch.autocast_increment_nesting() - 1
        torch.autocast_decrement_nesting()
        while now > nesting:
            now = torch.autocast_decrement_nesting()
        while now < nesting:
            now = torch.autocast_increment_nesting()
        if rng:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            random.setstate(py_rng)


# ---------------------------------------------------------------------------- outputs


CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                  torch.Size, enum.Enum, type(...))
SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def flatten_output(obj: Any) -> tuple[list[torch.Tensor], Any]:
    """Split an output into its tensors and a spec that rebuilds it.

    Plain constants are kept in the spec; symbolic sizes are outputs of the graph; types
    registered with torch's pytree (e.g. HuggingFace caches) are flattened by it. Anything
    else raises TypeError, so the module runs eagerly instead of returning a stale object.
    """
    leaves: list[Any] = []

    def walk(o: Any) -> Any:
        if isinstance(o, (torch.Tensor, *SYMBOLIC)):
            leaves.append(o)
            return ("T", len(leaves) - 1)
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            if isinstance(o, dict):  # HuggingFace ModelOutput: a dict and a dataclass
                return ("M", type(o), [(k, walk(v)) for k, v in o.items()])
            fields = [(f.name, walk(getattr(o, f.name))) for f in dataclasses.fields(o)]
            return ("D", o, fields)
        if isinstance(o, dict):
            return ("d", o, [(k, walk(v)) for k, v in o.items()])
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return ("n", type(o), [walk(v) for v in o])
        if isinstance(o, (list, tuple)):
            return ("l", type(o), [walk(v) for v in o])
        if isinstance(o, CONSTANT_TYPES):
            return ("C", o)
        children, treespec = pytree.tree_flatten(o)
        if treespec.is_leaf():
            raise TypeError(
                f"the model returns a {type(o).__name__}, which ampgraph cannot rebuild from a "
                "captured graph; register it with torch.utils._pytree or return tensors"
            )
        return ("P", treespec, [walk(c) for c in children])

    return leaves, walk(obj)


def unflatten_output(spec: Any, leaves: Any) -> Any:
    """Inverse of :func:`flatten_output`."""
    tag = spec[0]
    if tag == "T":
        return leaves[spec[1]]
    if tag == "C":
        return spec[1]
    if tag == "M":
        return spec[1](**{k: unflatten_output(s, leaves) for k, s in spec[2]})
    if tag == "D":
        obj = copy_dataclass(spec[1])
        for name, s in spec[2]:
            object.__setattr__(obj, name, unflatten_output(s, leaves))
        return obj
    if tag == "d":
        out = spec[1].copy()
        for k, s in spec[2]:
            out[k] = unflatten_output(s, leaves)
        return out
    if tag == "n":
        return spec[1](*(unflatten_output(s, leaves) for s in spec[2]))
    if tag == "P":
        return pytree.tree_unflatten([unflatten_output(s, leaves) for s in spec[2]], spec[1])
    return spec[1](unflatten_output(s, leaves) for s in spec[2])


def copy_dataclass(obj: Any) -> Any:
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


def strip_tensors(spec: Any) -> Any:
    """Drop references to traced tensors from a spec's template objects."""
    tag = spec[0]
    if tag == "D":
        template = copy_dataclass(spec[1])
        for name, _ in spec[2]:
            object.__setattr__(template, name, None)
        return ("D", template, [(k, strip_tensors(s)) for k, s in spec[2]])
    if tag == "d":
        return ("d", _empty_like(spec[1]), [(k, strip_tensors(s)) for k, s in spec[2]])
    if tag in ("M",):
        return ("M", spec[1], [(k, strip_tensors(s)) for k, s in spec[2]])
    if tag in ("n", "l", "P"):
        return (tag, spec[1], [strip_tensors(s) for s in spec[2]])
    return spec


def _empty_like(d: dict) -> dict:
    out = d.copy()
    out.clear()
    return out


# ---------------------------------------------------------------------------- export


class ExportRoot(nn.Module):
    """Exports ``model(*args, **kwargs)`` with flat outputs, sharing the model's state.

    Its parameter, buffer and submodule dicts *are* the model's, so the exported graph
    refers to the user's own Parameter objects under the user's own names.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        share_state(self, model)
        self.__dict__["_amp_model"] = model
        box: dict[str, Any] = {}
        # torch.export restores container attributes the forward mutates, so the output
        # spec goes to a box only a closure can see.
        self.__dict__["_record_spec"] = lambda spec: box.__setitem__("spec", spec)
        self.__dict__["_out_spec"] = lambda: box["spec"]

    def forward(self, args: tuple, kwargs: dict) -> tuple:
        out = self.__dict__["_amp_model"](*args, **kwargs)
        leaves, spec = flatten_output(out)
        self.__dict__["_record_spec"](spec)
        return tuple(leaves)


def share_state(dst: nn.Module, src: nn.Module) -> None:
    """Make ``dst`` see ``src``'s parameters, buffers and submodules (the same dicts)."""
    for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        dst.__dict__[name] = src.__dict__[name]
    dst.training = src.training


def dynamic_spec(inputs: Any) -> Any:
    """Every dimension of every tensor input may be dynamic (export specialises as needed)."""
    return tree_map(
        lambda t: {i: Dim.AUTO for i in range(t.dim())} if isinstance(t, torch.Tensor) else None,
        inputs,
    )


def signature(args: tuple, kwargs: dict) -> Any:
    """Hashable key of an input structure: pytree spec, tensor dtypes/devices/ranks,
    non-tensor values (export bakes those in)."""
    leaves, spec = tree_flatten((args, kwargs))
    parts = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            parts.append(("T", leaf.dtype, leaf.device, leaf.dim()))
        else:
            try:
                hash(leaf)
                parts.append(("C", type(leaf), leaf))
            except TypeError:
                parts.append(("C", type(leaf), id(leaf)))
    return (str(spec), tuple(parts))


@dataclass
class Captured:
    """One exported graph and what it needs to run."""

    gm: fx.GraphModule
    out_spec: Any
    dims: list[tuple]  # per tensor input: per dim an int (static) or (symbol, lo, hi)

    def accepts(self, args: tuple, kwargs: dict) -> bool:
        """Whether the inputs' shapes satisfy what the graph was specialised on."""
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if len(tensors) != len(self.dims):
            return False
        bound: dict[Any, int] = {}
        for t, dims in zip(tensors, self.dims):
            if t.dim() != len(dims):
                return False
            for size, d in zip(t.shape, dims):
                if isinstance(d, int):
                    if size != d:
                        return False
                elif d is not None:
                    sym, lo, hi = d
                    if bound.setdefault(sym, size) != size or not lo <= size <= hi:
                        return False
        return True


def export_module(model: nn.Module, args: tuple, kwargs: dict) -> Captured:
    """Export ``model`` at aten level with dynamic dims; raises what torch.export raises."""
    root = ExportRoot(model)
    inputs = (tuple(args), dict(kwargs))
    with preserved_global_state(), quiet_export_logs():
        ep = torch.export.export(root, inputs, dynamic_shapes=dynamic_spec(inputs),
                                 strict=False)
    gm = ep.module()
    _repoint_state(gm, model)
    dims = []
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            dims.append(tuple(_dim_spec(s, ranges) for s in node.meta["val"].shape))
    return Captured(gm, strip_tensors(root.__dict__["_out_spec"]()), dims)


@contextlib.contextmanager
def quiet_export_logs():
    """Silence torch.export's own chatter: it logs each 0/1 specialisation, and prints the
    partial graph to stderr when it fails. ampgraph reports failures itself (a warning and
    ``explain``). Warnings raised meanwhile still reach the user."""
    names = ("torch._export.non_strict_utils", "torch.fx.experimental.symbolic_shapes",
             "torch._dynamo", "torch.export")
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("default")
            yield
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _dim_spec(size: Any, ranges: dict) -> Any:
    if isinstance(size, int):
        return size
    expr = size.node.expr
    if not getattr(expr, "is_Symbol", False):
        return None  # a derived size: the graph's own guard checks it
    vr = ranges.get(str(expr))
    lo = int(vr.lower) if vr is not None else 0
    hi = float(vr.upper) if vr is not None else float("inf")
    return (str(expr), lo, hi)


def _repoint_state(gm: fx.GraphModule, model: nn.Module) -> None:
    """Make the graph module use the user's Parameter/buffer objects (master weights)."""
    for name, value in (*model.named_parameters(remove_duplicate=False),
                        *model.named_buffers(remove_duplicate=False)):
        owner_path, _, attr = name.rpartition(".")
        try:
            owner = gm.get_submodule(owner_path) if owner_path else gm
        except AttributeError:
            continue
        current = owner.__dict__.get("_parameters", {}).get(attr)
        if current is None:
            current = owner.__dict__.get("_buffers", {}).get(attr)
        if current is not None and current is not value:
            if isinstance(value, nn.Parameter):
                owner._parameters[attr] = value
            else:
                owner._buffers[attr] = value
