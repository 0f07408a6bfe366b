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
import operator
import random
import sys
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.export import Dim
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_flatten

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



# ---------------------------------------------------------------------------- HF caches

_registry_lock = threading.Lock()
_hf_caches_registered = False


def register_hf_caches() -> None:
    """Make transformers' ``DynamicCache`` and ``EncoderDecoderCache`` pytree nodes, so a
    model taking or returning them is exported whole (their tensors become graph inputs
    and outputs, and the caller gets cache objects back).

    DynamicCache uses transformers' own ``register_dynamic_cache_export_support``;
    EncoderDecoderCache is a node whose children are its two caches. Idempotent and lazy:
    nothing happens until transformers' cache module has been imported by the user, and a
    type somebody registered already (the user, transformers) is left as it is.
    """
    global _hf_caches_registered
    if _hf_caches_registered:
        return
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None:
        return
    with _registry_lock:
        if _hf_caches_registered:
            return
        dynamic = getattr(cache_utils, "DynamicCache", None)
        if dynamic is not None and dynamic not in pytree.SUPPORTED_NODES:
            try:
                from transformers.integrations.executorch import (
                    register_dynamic_cache_export_support,
                )
            except ImportError:  # an older or newer transformers: caches stay eager
                pass
            else:
                register_dynamic_cache_export_support()
        encdec = getattr(cache_utils, "EncoderDecoderCache", None)
        if encdec is not None and encdec not in pytree.SUPPORTED_NODES:
            _register_encoder_decoder_cache(encdec)
        _hf_caches_registered = True


_ENCDEC_FIELDS = ("self_attention_cache", "cross_attention_cache")


def _register_encoder_decoder_cache(cls: type) -> None:
    def flatten(cache: Any) -> tuple[list, Any]:
        return [getattr(cache, f) for f in _ENCDEC_FIELDS], None

    def flatten_with_keys(cache: Any) -> tuple[list, Any]:
        return [(pytree.GetAttrKey(f), getattr(cache, f)) for f in _ENCDEC_FIELDS], None

    def unflatten(children: Any, context: Any) -> Any:
        return cls(*children)  # recomputes is_updated from the cross-attention cache

    try:
        pytree.register_pytree_node(
            cls, flatten, unflatten, flatten_with_keys_fn=flatten_with_keys,
            serialized_type_name=f"{cls.__module__}.{cls.__name__}")
    except ValueError as exc:  # registered meanwhile by someone else: theirs stands
        if "already registered" not in str(exc):
            raise


# ---------------------------------------------------------------------------- no-grad regions


def inline_no_grad_regions(gm: fx.GraphModule) -> int:
    """Inline ``wrap_with_set_grad_enabled(False, body, *inputs)`` calls (a ``no_grad``
    block or ``@torch.no_grad`` forward inside the model, e.g. HF rotary embeddings) into
    ``gm``, each tensor input detached: the body's values and their autograd meaning (no
    gradient flows through it, its outputs do not require grad) are kept, and the AMP
    passes see plain aten ops instead of a higher-order op they cannot re-run. Bodies
    with attributes of their own, and ``set_grad_enabled(True)`` blocks, are left as they
    are. Returns the number of calls inlined.

    The inlined ops are painted like any others, as they are when the model is captured
    under ``torch.no_grad`` (export then records no region at all)."""
    hop = getattr(torch.ops.higher_order, "wrap_with_set_grad_enabled", None)
    graph = gm.graph
    inlined = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not hop or node.args[0] is not False:
            continue
        body_node = node.args[1]
        if getattr(body_node, "op", None) != "get_attr":
            continue
        body = getattr(gm, body_node.target)
        inline_no_grad_regions(body)
        if any(n.op in ("get_attr", "call_module") for n in body.graph.nodes):
            continue
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        inputs = node.args[2:]
        if len(placeholders) != len(inputs) or node.kwargs:
            continue
        env: dict[fx.Node, Any] = {}
        lookup = env.__getitem__
        with graph.inserting_before(node):
            for ph, value in zip(placeholders, inputs):
                env[ph] = _detached(graph, value)
            result = None
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    result = fx.map_arg(inner.args[0], lookup)
                    break
                env[inner] = graph.node_copy(inner, lookup)
        outs = result if isinstance(result, (tuple, list)) else (result,)
        for user in list(node.users):
            if user.op == "call_function" and user.target is operator.getitem:
                user.replace_all_uses_with(outs[user.args[1]])
                graph.erase_node(user)
        if node.users:  # used as a whole (not seen from export): leave the rest alone
            continue
        graph.erase_node(node)
        if not body_node.users:
            graph.erase_node(body_node)
            delattr(gm, body_node.target)
        inlined += 1
    if inlined:
        graph.lint()
        gm.recompile()
    return inlined


def _detached(graph: fx.Graph, value: Any) -> Any:
    if not isinstance(value, fx.Node):
        return value
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor):
        return value
    node = graph.call_function(torch.ops.aten.detach.default, (value,))
    node.meta.update({k: v for k, v in value.meta.items() if k in ("nn_module_stack",
                                                                     "stack_trace")})
    fake_mode = getattr(val, "fake_mode", None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        node.meta["val"] = val.detach()
    return node


# ---------------------------------------------------------------------------- outputs


CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                  torch.Size, enum.Enum, type(...))
SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def flatten_output(obj: Any, inputs: list[Any] | tuple = ()) -> tuple[list[torch.Tensor], Any]:
    """Split an output into its tensors and a spec that rebuilds it.

    Plain constants are kept in the spec; symbolic sizes are outputs of the graph; types
    registered with torch's pytree (e.g. HuggingFace caches) are flattened by it; an
    object of ``inputs`` (see :func:`custom_objects`) returned as it is stays the caller's
    object (``"I"``). Anything else raises TypeError, so the module runs eagerly instead
    of returning a stale object.
    """
    flattener = _Flattener(inputs)
    return flattener.leaves, flattener.walk(obj)


class _Flattener:
    def __init__(self, inputs: list[Any] | tuple = ()):
        self.leaves: list[Any] = []
        self.inputs = {id(o): k for k, o in enumerate(inputs)}

    def walk(self, o: Any) -> Any:
        walk = self.walk
        if isinstance(o, (torch.Tensor, *SYMBOLIC)):
            self.leaves.append(o)
            return ("T", len(self.leaves) - 1)
        if id(o) in self.inputs:
            return ("I", self.inputs[id(o)])
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
        return self.walk_pytree(o)

    def walk_pytree(self, o: Any) -> Any:
        children, treespec = pytree.tree_flatten(o)
        if treespec.is_leaf():
            raise TypeError(
                f"the model returns a {type(o).__name__}, which ampgraph cannot rebuild from a "
                "captured graph; register it with torch.utils._pytree or return tensors"
            )
        return ("P", treespec, [self.walk(c) for c in children])


def unflatten_output(spec: Any, leaves: Any, inputs: list[Any] | tuple = ()) -> Any:
    """Inverse of :func:`flatten_output` (``inputs``: the call's :func:`custom_objects`)."""
    tag = spec[0]
    if tag == "T":
        return leaves[spec[1]]
    if tag == "C":
        return spec[1]
    if tag == "I":
        return inputs[spec[1]]
    if tag == "M":
        return spec[1](**{k: unflatten_output(s, leaves, inputs) for k, s in spec[2]})
    if tag == "D":
        obj = copy_dataclass(spec[1])
        for name, s in spec[2]:
            object.__setattr__(obj, name, unflatten_output(s, leaves, inputs))
        return obj
    if tag == "d":
        out = spec[1].copy()
        for k, s in spec[2]:
            out[k] = unflatten_output(s, leaves, inputs)
        return out
    if tag == "n":
        return spec[1](*(unflatten_output(s, leaves, inputs) for s in spec[2]))
    if tag == "P":
        return pytree.tree_unflatten([unflatten_output(s, leaves, inputs) for s in spec[2]],
                                     spec[1])
    return spec[1](unflatten_output(s, leaves, inputs) for s in spec[2])


def _uses_inputs(spec: Any) -> bool:
    tag = spec[0]
    if tag == "I":
        return True
    if tag in ("M", "D", "d"):
        return any(_uses_inputs(s) for _, s in spec[2])
    if tag in ("n", "l", "P"):
        return any(_uses_inputs(s) for s in spec[2])
    return False


_BUILTIN_CONTAINERS = (tuple, list, dict)
_BUILTIN_NODE_TYPES = frozenset(pytree.BUILTIN_TYPES)


def custom_objects(tree: Any) -> list[Any]:
    """The outermost objects of an input pytree that are registered pytree nodes but not
    built-in containers (HuggingFace caches), in flattening order. A model may mutate
    them; the captured graph returns their new contents and :meth:`Captured.rebuild`
    writes them back into the caller's objects."""
    found: list[Any] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor) or pytree.tree_is_leaf(x):
            return
        if not isinstance(x, _BUILTIN_CONTAINERS):
            found.append(x)
            return
        children, _ = pytree.SUPPORTED_NODES[pytree._get_node_type(x)].flatten_fn(x)
        for child in children:
            visit(child)

    visit(tree)
    return found


def _changed(before: tuple[list, Any], obj: Any) -> bool:
    leaves, spec = pytree.tree_flatten(obj)
    old_leaves, old_spec = before
    return spec != old_spec or len(leaves) != len(old_leaves) or any(
        a is not b for a, b in zip(leaves, old_leaves))


def _assign(target: Any, fresh: Any) -> None:
    """Make the caller's object hold what the graph computed (its attributes replaced)."""
    target.__dict__.clear()
    target.__dict__.update(fresh.__dict__)


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
    if tag == "W":  # (out spec, [(input index, its spec)])
        return ("W", strip_tensors(spec[1]), [(k, strip_tensors(s)) for k, s in spec[2]])
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
        objs = custom_objects((args, kwargs))
        before = [pytree.tree_flatten(o) for o in objs]
        out = self.__dict__["_amp_model"](*args, **kwargs)
        flattener = _Flattener(objs)
        spec = flattener.walk(out)
        writeback = []
        for k, (obj, old) in enumerate(zip(objs, before)):
            if _changed(old, obj):  # e.g. a DynamicCache the model appended to
                if not hasattr(obj, "__dict__"):
                    raise TypeError(f"the model mutates its {type(obj).__name__} input, which "
                                    "ampgraph cannot update in place")
                writeback.append((k, flattener.walk_pytree(obj)))
        self.__dict__["_record_spec"](("W", spec, writeback))
        return tuple(flattener.leaves)


def share_state(dst: nn.Module, src: nn.Module) -> None:
    """Make ``dst`` see ``src``'s parameters, buffers and submodules (the same dicts)."""
    for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
        dst.__dict__[name] = src.__dict__[name]
    dst.training = src.training


def dynamic_spec(inputs: Any) -> Any:
    """Every dimension of every tensor input may be dynamic (export specialises as needed).

    A registered pytree node that is not a built-in container (a HuggingFace cache) gets
    the list of its children's specs, which is what torch.export expects for such types.
    """
    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(x.dim())}
        if pytree.tree_is_leaf(x):
            return None
        node_type = pytree._get_node_type(x)
        node = pytree.SUPPORTED_NODES[node_type]
        children, context = node.flatten_fn(x)
        specs = [spec(c) for c in children]
        if node_type in _BUILTIN_NODE_TYPES:
            return node.unflatten_fn(specs, context)
        return specs  # e.g. a cache, a ModelOutput passed back in (encoder_outputs)

    return spec(inputs)


def signature(args: tuple, kwargs: dict) -> Any:
    """Hashable key of an input structure: pytree spec, tensor dtypes/devices/ranks,
    non-tensor values (export bakes those in)."""
    register_hf_caches()  # a cache input is flattened the same way here and in export
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
    # (index in custom_objects(inputs), spec of its new contents) for inputs the model mutates
    writeback: list[tuple[int, Any]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        self.uses_inputs = bool(self.writeback) or _uses_inputs(self.out_spec)

    def rebuild(self, flat: Any, args: tuple, kwargs: dict) -> Any:
        """The user's output structure from the graph's flat outputs; inputs the model
        mutated (HuggingFace caches) are updated in place first, as eager would have."""
        if not self.uses_inputs:
            return unflatten_output(self.out_spec, flat)
        objs = custom_objects((args, kwargs))
        for k, spec in self.writeback:
            _assign(objs[k], unflatten_output(spec, flat))
        return unflatten_output(self.out_spec, flat, objs)

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
    register_hf_caches()
    root = ExportRoot(model)
    inputs = (tuple(args), dict(kwargs))
    with preserved_global_state(), quiet_export_logs():
        ep = torch.export.export(root, inputs, dynamic_shapes=dynamic_spec(inputs),
                                 strict=False)
    gm = ep.module()
    inline_no_grad_regions(gm)
    _repoint_state(gm, model)
    dims = []
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            dims.append(tuple(_dim_spec(s, ranges) for s in node.meta["val"].shape))
    _, out_spec, writeback = strip_tensors(root.__dict__["_out_spec"]())
    return Captured(gm, out_spec, dims, writeback)


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
