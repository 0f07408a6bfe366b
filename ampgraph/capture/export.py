"""torch.export of a module as a root taking ``(args, kwargs)`` and returning a flat tuple, so
any forward signature and output structure work; one :class:`Captured` graph per
(mode, input structure)."""


from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_flatten

from ampgraph.capture.guards import StateGuards
from ampgraph.capture.hf_caches import register_hf_caches
from ampgraph.capture.numbers import as_numbers, as_tensors
from ampgraph.capture.opaque import describe_opaque_nodes
from ampgraph.capture.own_state import parameter_caches
from ampgraph.capture.structure import (
    Flattener,
    assign_contents,
    contents_changed,
    custom_objects,
    exportable_inputs,
    restored_inputs,
    spec_uses_inputs,
    strip_tensors,
    unflatten_output,
)
from ampgraph.capture.trace import traced
from ampgraph.capture.watch import active
from passes.fx.autocast_regions import inline_autocast_off_regions
from passes.fx.fold.constant_casts import FOLDED_KEY
from passes.fx.no_grad_regions import inline_no_grad_regions


class ExportRoot(nn.Module):
    """Exports ``model(*args, **kwargs)`` with flat outputs, sharing the model's state.

    Its parameter, buffer and submodule dicts *are* the model's, so the exported graph
    refers to the user's own Parameter objects under the user's own names. ``changed`` says
    where export is given another form of the inputs (a ``torch.Size`` as a tuple, a dtype
    as None: :func:`~ampgraph.capture.structure.exportable_inputs`): the model gets the
    originals back.
    """

    def __init__(self, model: nn.Module, changed: Any = None, numbers: tuple[int, ...] = ()):
        super().__init__()
        share_state(self, model)
        self.__dict__["_amp_model"] = model
        self.__dict__["_amp_changed"] = changed
        self.__dict__["_amp_numbers"] = numbers  # leaves given as 0-d tensors
        box: dict[str, Any] = {}
        # torch.export restores container attributes the forward mutates, so the output
        # spec goes to a box only a closure can see.
        self.__dict__["_record_spec"] = lambda spec: box.__setitem__("spec", spec)
        self.__dict__["_out_spec"] = lambda: box["spec"]

    def forward(self, args: tuple, kwargs: dict) -> tuple:
        args, kwargs = restored_inputs((args, kwargs), self.__dict__["_amp_changed"])
        if self.__dict__["_amp_numbers"]:  # the model gets symbolic numbers
            args, kwargs = as_numbers(args, kwargs, self.__dict__["_amp_numbers"])
        objs = custom_objects((args, kwargs))
        before = [pytree.tree_flatten(o) for o in objs]
        model = self.__dict__["_amp_model"]
        out = model(*args, **kwargs)
        watch = active()
        if watch is not None:  # what stood in for its tensors: a cache of them is no leak
            watch.own.update(map(id, (*model.parameters(), *model.buffers())))
            watch.own.update(parameter_caches(model, (args, kwargs)))
        flattener = Flattener(objs)
        spec = flattener.walk(out)
        writeback = []
        for k, (obj, old) in enumerate(zip(objs, before)):
            if contents_changed(old, obj):  # e.g. a DynamicCache the model appended to
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


def signature(args: tuple, kwargs: dict) -> Any:
    """Hashable key of an input structure: pytree spec, tensor dtypes/devices/ranks,
    non-tensor values (export bakes those in)."""
    return signature_of(*flatten_inputs(args, kwargs))


def flatten_inputs(args: tuple, kwargs: dict) -> tuple[list[Any], Any]:
    """(leaves, spec) of a call's inputs, HF caches included; once per call.

    Positional tensors only (the common call) skip pytree: their spec depends only on how
    many there are, and is kept per count."""
    if not kwargs and all(type(a) is torch.Tensor or type(a) is nn.Parameter for a in args):
        spec = _TENSOR_ARGS_SPECS.get(len(args))
        if spec is None:
            spec = _TENSOR_ARGS_SPECS[len(args)] = tree_flatten((tuple(args), {}))[1]
        return list(args), spec
    register_hf_caches()  # a cache input is flattened the same way here and in export
    return tree_flatten((args, kwargs))


_TENSOR_ARGS_SPECS: dict[int, Any] = {}


def signature_of(leaves: list[Any], spec: Any, numbers: Any = ()) -> Any:
    """:func:`signature` from already flattened inputs; the leaves at ``numbers`` count by
    their type only (graph inputs, ``capture/numbers.py``)."""
    parts = []
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            parts.append(("T", leaf.dtype, leaf.device, leaf.dim()))
        elif numbers and i in numbers:
            parts.append(("N", type(leaf)))
        else:
            try:
                hash(leaf)
                parts.append(("C", type(leaf), leaf))
            except TypeError:
                parts.append(("C", type(leaf), id(leaf)))
    try:
        hash(spec)
    except TypeError:  # a context that cannot be hashed: its text stands in
        spec = str(spec)
    return (spec, tuple(parts))


@dataclass
class Captured:
    """One exported graph and what it needs to run."""

    gm: fx.GraphModule
    out_spec: Any
    dims: list[tuple]  # per tensor input: per dim an int (static) or (symbol, lo, hi)
    # (index in custom_objects(inputs), spec of its new contents) for inputs the model mutates
    writeback: list[tuple[int, Any]] = dataclasses.field(default_factory=list)
    # export's guards on the input sizes, taken out of the graph (see _hoist_guards)
    guards: Any = None
    # the Python state the trace read (capture/guards.py), checked on every call
    state: StateGuards | None = None
    # keys of the calls kept out of the graph (capture/opaque.py), until they are bound
    opaque_keys: list[int] = dataclasses.field(default_factory=list)
    # positions of the number arguments the graph takes as 0-d tensors (capture/numbers.py)
    numbers: tuple[int, ...] = ()
    model: Any = None  # the module exported (its tensors, for repoint)

    def __post_init__(self) -> None:
        self.uses_inputs = bool(self.writeback) or spec_uses_inputs(self.out_spec)
        self._guarded: set[tuple] = set()  # input shapes the guards passed

    def repoint(self) -> bool:
        """Point the graph at the model's tensors as they are now (:func:`repoint_state`)."""
        return repoint_state(self.gm, self.model)

    def rebuild(self, flat: Any, args: tuple, kwargs: dict) -> Any:
        """The user's output structure from the graph's flat outputs; inputs the model
        mutated (HuggingFace caches) are updated in place first, as eager would have."""
        if not self.uses_inputs:
            return unflatten_output(self.out_spec, flat)
        objs = custom_objects((args, kwargs))
        for k, spec in self.writeback:
            assign_contents(objs[k], unflatten_output(spec, flat))
        return unflatten_output(self.out_spec, flat, objs)

    def accepts_leaves(self, leaves: list[Any]) -> bool:
        """Whether the flattened inputs' shapes satisfy what the graph was specialised on."""
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
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
        return self.guards is None or self._guards_pass(leaves, tensors)

    def _guards_pass(self, leaves: list[Any], tensors: list[torch.Tensor]) -> bool:
        """Whether export's guards hold for these inputs, remembered per input shapes
        (non-tensor inputs are part of the graph's signature): they depend on nothing else,
        and symbolic sizes through windows and patches (Swin's, were its image sizes not
        static) give hundreds (docs/performance.md#graph-overhead-on-small-models)."""
        shapes = tuple(t.shape for t in tensors)
        if shapes in self._guarded:
            return True
        try:
            self.guards(*leaves)
        except AssertionError:  # torch._assert's: another graph is captured for them
            return False
        if len(self._guarded) >= MAX_GUARDED_SHAPES:
            self._guarded.clear()
        self._guarded.add(shapes)
        return True


MAX_GUARDED_SHAPES = 1024


def export_module(model: nn.Module, args: tuple, kwargs: dict, name: str = "model",
                  numbers: tuple[int, ...] = ()) -> Captured:
    """Export ``model`` at aten level with dynamic dims (``dynamic_dims.dynamic_spec``: an
    image's static past its batch); raises what torch.export raises, or
    :class:`UnsupportedInput` without trying it. The Python state the trace read is
    guarded (``Captured.state``; ``name`` is the model's name in what the guards report).
    The number arguments at the leaf positions ``numbers`` become inputs of the graph
    (``capture/numbers.py``)."""
    register_hf_caches(rescan=True)
    if numbers:
        args, kwargs = as_tensors(tuple(args), dict(kwargs), numbers)
    inputs, changed = exportable_inputs((tuple(args), dict(kwargs)))
    check_exportable(*inputs)
    root = ExportRoot(model, changed, numbers)
    ep, watch = traced(model, root, inputs, name)  # capture/trace.py: faithfully
    gm = ep.module()
    # The unlifted module checks its inputs' structure and shapes in a forward pre-hook
    # (docs/performance.md#graph-overhead-on-small-models). AmpModule already keys graphs on the
    # input structure (`signature`) and checks shapes (`Captured.accepts`); the graph's
    # own guard function still runs inside forward.
    gm.validate_inputs = False
    guards = _hoist_guards(gm, flatten_inputs(args, kwargs)[0])
    inline_autocast_off_regions(gm)  # before: a no_grad body holding one is then inlined
    inline_no_grad_regions(gm)
    repoint_state(gm, model)
    dims = []
    ranges = {str(k): v for k, v in ep.range_constraints.items()}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and isinstance(node.meta.get("val"), torch.Tensor):
            dims.append(tuple(_dim_spec(s, ranges) for s in node.meta["val"].shape))
    describe_opaque_nodes(gm)
    _, out_spec, writeback = strip_tensors(root.__dict__["_out_spec"]())
    return Captured(gm, out_spec, dims, writeback, guards, StateGuards(model, watch, name),
                    watch.emitted, numbers, model)


class UnsupportedInput(TypeError):
    """An input torch.export cannot take: the module runs eagerly (see :func:`check_exportable`)."""


# what torch.export takes as an input leaf (pytree containers are flattened first)
EXPORT_LEAVES = (torch.Tensor, bool, int, float, str, enum.Enum, nn.Module, torch.ScriptObject)


def check_exportable(args: tuple, kwargs: dict) -> None:
    """Raise :class:`UnsupportedInput`, naming the argument, if an input holds an object
    torch.export cannot take (neither a tensor, a plain constant nor a container registered
    with ``torch.utils._pytree``: e.g. transformers' ``KVSharingDict``), before export is
    tried. Run it on :func:`~ampgraph.capture.structure.exportable_inputs`' result.

    Example:
        >>> check_exportable((object(),), {})
        Traceback (most recent call last):
        ...
        ampgraph.capture.export.UnsupportedInput: argument 0 is a builtins.object, ...
    """
    named = [(f"argument {i}", a) for i, a in enumerate(args)]
    named += [(f"argument `{k}`", v) for k, v in kwargs.items()]
    for name, value in named:
        for leaf in pytree.tree_leaves(value):
            if leaf is not None and not isinstance(leaf, EXPORT_LEAVES):
                kind = type(leaf)
                raise UnsupportedInput(
                    f"{name} is a {kind.__module__}.{kind.__qualname__}, which torch.export "
                    "cannot take as an input (tensors, None, bool, int, float, str and "
                    "containers registered with torch.utils._pytree can be taken); register "
                    "the type with torch.utils._pytree.register_pytree_node to capture the "
                    "module")


def _hoist_guards(gm: fx.GraphModule, leaves: list[Any]) -> nn.Module | None:
    """Take the call of export's guard function (asserts on the input sizes: ranges,
    equalities, divisibility) out of the graph, with the unlifted module's hooks around
    each call, and return the function for :class:`Captured` to call once per new input
    shapes. Left as it is (None) unless the call takes exactly the flat inputs, one per
    leaf, and no input is a module (the hooks' only work is for such inputs)."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target == "_guards_fn"]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(calls) != 1 or list(calls[0].args) != placeholders \
            or len(placeholders) != len(leaves) or any(isinstance(x, nn.Module) for x in leaves):
        return None
    gm.graph.erase_node(calls[0])
    gm.recompile()
    for hooks in (gm._forward_pre_hooks, gm._forward_pre_hooks_with_kwargs, gm._forward_hooks,
                  gm._forward_hooks_always_called):
        hooks.clear()  # validate_inputs is off; the others only act on module inputs
    return gm._guards_fn


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


def repoint_state(gm: fx.GraphModule, model: nn.Module) -> bool:
    """Make the graph module, and the graphs of its outlined regions (``.gm`` of a
    call's target), use the model's tensors as they are now: its Parameters and buffers
    (master weights) and the plain tensor attributes export read as constants (after
    :meth:`~ampgraph.capture.guards.StateGuards.changes` found some swapped for like ones:
    ``functional_call``, a pre-forward hook assigning a module's weight). False when a
    changed constant was folded into the graph (it must be captured again).

    Example:
        >>> repoint_state(captured.gm, model)  # doctest: +SKIP
        True
    """
    ok = _repoint_one(gm, model)
    for node in gm.graph.nodes:
        sub = getattr(node.target, "gm", None) if node.op == "call_function" else None
        if isinstance(sub, fx.GraphModule):
            ok = repoint_state(sub, model) and ok
    return ok


def _repoint_one(gm: fx.GraphModule, model: nn.Module) -> bool:
    folded = gm.meta.get(FOLDED_KEY, ())
    ok = True
    for path, module in model.named_modules(remove_duplicate=False):
        try:
            owner = gm.get_submodule(path) if path else gm
        except AttributeError:
            continue
        for kind in ("_parameters", "_buffers", "__dict__"):
            mine = module._parameters if kind == "_parameters" else \
                module._buffers if kind == "_buffers" else module.__dict__
            held = owner.__dict__ if kind == "__dict__" else owner.__dict__.get(kind)
            for attr, value in mine.items():
                if not isinstance(value, torch.Tensor) or held is None:
                    continue
                current = held.get(attr)  # the entry's own dict (functional_call puts
                if current is None or current is value:  # plain tensors in _parameters)
                    continue
                held[attr] = value
                if kind == "__dict__" and f"{path}.{attr}".lstrip(".") in folded:
                    ok = False
    return ok
