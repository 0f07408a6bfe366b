"""Dtype propagation after cast insertion: the dtype each rewritten node now outputs.

An op whose float inputs and outputs all had one dtype in the captured graph follows its
first float input; any other op is re-run on fake tensors to learn its output dtype, once
per signature (op, input dtypes/shapes/strides, other arguments): an op met again with a
signature already run, whose value already matches that run's result, keeps it (see
:class:`DtypeTracker`). ``exact=True`` re-runs every op: slower, used by tests to check the
fast paths.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from passes._infra import PassError
from passes.fx._torch_internals import (
    FakeTensor,
    detect_fake_mode,
    enable_python_dispatcher,
    has_symbolic_sizes_strides,
    input_nodes,
    tree_map,
)
from passes.fx.dtypes import NO_FLOATS, dtype_of, float_dtypes, set_dtype
from passes.fx.nodes import FLOATS, op_key, tensors
from passes.fx.rules import input_slots

UNKNOWN = object()  # a dtype not known yet (DtypeTracker learns it by running the op)
_PLAIN = (int, float, bool, str, torch.SymInt, torch.SymFloat, torch.SymBool)


def graph_fake_mode(nodes: list[fx.Node]) -> Any:
    """``detect_fake_mode`` over the nodes' values, handed one fake tensor per fake mode.

    Which mode it returns, and whether it finds two, depends only on the order in which
    modes first appear; a graph holds tens of thousands of fake tensors of one mode.

    Example:
        >>> graph_fake_mode(list(gm.graph.nodes)) is x_node.meta["val"].fake_mode
        True
    """
    leaves: list[Any] = []
    modes: set[int] = set()

    def visit(v: Any) -> None:
        if isinstance(v, FakeTensor):
            if id(v.fake_mode) not in modes:
                modes.add(id(v.fake_mode))
                leaves.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif v is not None and not isinstance(v, _PLAIN):
            leaves.append(v)  # anything else (a tensor subclass ...): as it is

    last = None  # the mode of the last fake tensor seen (almost always the only one)
    for n in nodes:
        v = n.meta.get("val")
        if type(v) is FakeTensor and v.fake_mode is last:
            continue
        visit(v)
        if type(v) is FakeTensor:
            last = v.fake_mode
    return detect_fake_mode(leaves)


def _names_dtype(node: fx.Node) -> bool:
    for v in node.args:
        if isinstance(v, torch.dtype):
            return True
    for v in node.kwargs.values():
        if isinstance(v, torch.dtype):
            return True
    return False


class _Unkeyable(Exception):
    """A value :func:`_sig` cannot describe exactly (the op is then re-run)."""


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)


def _dims(sizes: Any) -> tuple:
    dims = tuple(sizes)
    for d in dims:
        if type(d) is not int:
            return tuple(_dim(d) for d in dims)
    return dims


def _dim(d: Any) -> Any:
    if type(d) is int:
        return d
    if isinstance(d, torch.SymInt):
        return ("sym", str(d))  # one expression over the graph's shape symbols
    raise _Unkeyable


_STRIDED = torch.strided


def _sig(value: Any) -> Any:
    """Everything of a meta value an op's output dtypes, shapes and strides can depend on."""
    if type(value) is FakeTensor:
        if value.layout is not _STRIDED:
            raise _Unkeyable
        offset = value.storage_offset()
        if not has_symbolic_sizes_strides(value) and type(offset) is int:
            return (value.dtype, value.shape, value.stride(), offset, value.fake_device,
                    value.requires_grad)
        return (value.dtype, _dims(value.shape), _dims(value.stride()), _dim(offset),
                value.fake_device, value.requires_grad)
    if isinstance(value, torch.Tensor):
        raise _Unkeyable  # a real tensor or another subclass
    if isinstance(value, (tuple, list)):
        return (type(value), tuple([_sig(v) for v in value]))
    if isinstance(value, _SCALARS):
        return (type(value), value)
    raise _Unkeyable


class DtypeTracker:
    """Learns the dtype a rewritten node outputs (``meta["amp_dtype"]``, ``meta["val"]``).

    - An op whose float inputs and outputs all had one dtype in the captured graph, with
      one tensor output, follows its first float input (a rule).
    - Any other op is run on fake tensors with its inputs in their new dtypes. The result
      is a function of the op, of its tensor inputs' dtypes, shapes, strides, offsets,
      devices and ``requires_grad``, and of its other arguments, so runs are remembered by
      those: an op met again with the same signature whose ``meta["val"]`` already matches
      the remembered result keeps it (running it would rebuild an identical value; e.g. an
      fp32 layer norm fed its original dtypes again), otherwise it runs. Values that cannot
      be described exactly (real tensors, unhashable arguments) always run, and so does
      operator ``getitem`` (no kernel, it returns the producer's own tensor).

    ``exact=True`` runs every op (the reference the tests compare the rule with).

    Example:
        >>> tracker = DtypeTracker(graph_fake_mode(nodes), exact=False)
    """

    def __init__(self, fake_mode: Any, exact: bool):
        self.fake_mode = fake_mode
        self.exact = exact
        self.results: dict[Any, Any] = {}  # run signature -> output signature
        # node -> its captured float dtypes (amp_orig_val never changes in the pass)
        self._orig_floats: dict[fx.Node, frozenset] = {}
        self._shared: dict[frozenset, frozenset] = {}
        self._source_keys: dict[fx.Node, tuple[Any, Any, Any]] = {}  # input -> key
        # the captured graph has at most one float dtype, so every op's float inputs and
        # outputs had it: an op follows its inputs unless it names a dtype
        self.one_float = False

    def propagate(self, node: fx.Node, first: Any = UNKNOWN,
                  swap: Mapping[fx.Node, fx.Node] | None = None) -> None:
        """Set ``node``'s dtype after its inputs were rewired. ``first``: the dtype of its
        first float input, when the caller knows it (None: it has none). ``swap``: the
        inputs that were replaced, each by the node now in its place (None: unknown)."""
        if not self.exact:
            val = node.meta.get("val")
            single = isinstance(val, torch.Tensor) or len(tensors(val)) == 1
            if single and self._follows_inputs(node):
                if first is UNKNOWN:
                    first = next((d for _, a in input_slots(node) if (d := dtype_of(a)) in FLOATS),
                                 None)
                if first is not None:
                    set_dtype(node, first)
                    return
            if node.target is not operator.getitem:
                if swap is not None and _sees_captured_inputs(node, swap):
                    node.meta.pop("amp_dtype", None)  # its captured value still holds
                    set_dtype(node, dtype_of(node))
                    return
                key = self._run_key(node)
                if key is not None:
                    known = self.results.get(key)
                    if known is not None and known == _val_sig(val):
                        node.meta.pop("amp_dtype", None)
                        set_dtype(node, dtype_of(node))
                        return
                    self._run(node)
                    out = _val_sig(node.meta.get("val"))
                    if out is not None:
                        self.results[key] = out
                    return
        self._run(node)

    def _floats_of(self, a: fx.Node, own: bool) -> frozenset:
        """:func:`float_dtypes` of a node's captured value (``own``: no ``val`` fallback).

        Cached where it cannot change during the pass: ``amp_orig_val``, and the value of a
        cast (casts are never re-run).
        """
        meta = a.meta
        if own and "amp_orig_val" not in meta:
            return NO_FLOATS
        hit = self._orig_floats.get(a)
        if hit is not None:
            return hit
        if "amp_orig_val" in meta:
            found = float_dtypes(meta["amp_orig_val"])
        elif meta.get("amp_cast"):
            found = float_dtypes(meta.get("val"))
        else:
            return float_dtypes(meta.get("val"))
        hit = self._orig_floats[a] = self._shared.setdefault(found, found)
        return hit

    def _follows_inputs(self, node: fx.Node) -> bool:
        """In the captured graph, all float inputs and outputs of ``node`` had one dtype,
        and it names no dtype (each node's captured dtypes are looked up once)."""
        if self.one_float:  # (no float at all: the caller finds no first float input)
            return not _names_dtype(node)
        floats_of, cache = self._floats_of, self._orig_floats
        dtypes = cache.get(node)  # only nodes with amp_orig_val or casts are cached
        if dtypes is None or node.meta.get("amp_cast"):
            dtypes = floats_of(node, True)
        for a in input_nodes(node):  # all_input_nodes without its copy: a dict, same order
            more = cache.get(a)
            if more is None:
                more = floats_of(a, False)
            if more is not dtypes:
                dtypes = dtypes | more
                if len(dtypes) > 1:
                    return False  # the union only grows
        return len(dtypes) == 1 and not _names_dtype(node)

    def _run_key(self, node: fx.Node) -> Any:
        """The signature of re-running ``node`` now, or None when it cannot be keyed."""
        arg_key = self._arg_key
        try:
            key = (node.target, tuple([arg_key(a) for a in node.args]),
                   tuple([(k, arg_key(v)) for k, v in node.kwargs.items()]))
            hash(key)
        except (_Unkeyable, TypeError):
            return None
        return key

    def _arg_key(self, a: Any) -> Any:
        """:func:`_arg_key`; a parameter's or input's key (their values are shared by many
        ops and never re-run) is worked out once."""
        if isinstance(a, fx.Node) and a.op in ("get_attr", "placeholder"):
            val, dtype = a.meta.get("val"), dtype_of(a)
            hit = self._source_keys.get(a)
            if hit is None or hit[0] is not val or hit[1] != dtype:
                hit = self._source_keys[a] = (val, dtype, _arg_key(a))
            return hit[2]
        return _arg_key(a)

    def _run(self, node: fx.Node) -> None:
        fake_mode = self.fake_mode

        def val(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            v = a.meta.get("val")
            want = dtype_of(a)
            if isinstance(v, torch.Tensor) and want is not None and v.dtype != want:
                with fake_mode:
                    v = v.to(want)
            return v

        args = tree_map(val, node.args)
        kwargs = tree_map(val, node.kwargs)
        try:
            with fake_mode:
                node.meta["val"] = node.target(*args, **kwargs)
        except Exception as exc:
            # an op whose C++ kernel cannot take symbolic sizes (aten.lstm.input calls
            # numel()): export traced it through torch's Python decompositions; so does this
            try:
                with fake_mode, enable_python_dispatcher():
                    node.meta["val"] = node.target(*args, **kwargs)
            except Exception:
                raise PassError("insert_casts", node.name, f"could not re-run {op_key(node)} "
                                f"on the new dtypes: {exc}") from exc
        node.meta.pop("amp_dtype", None)
        set_dtype(node, dtype_of(node))


def _sees_captured_inputs(node: fx.Node, swap: Mapping[fx.Node, fx.Node]) -> bool:
    """Every input of ``node`` is what it was at capture: the captured node itself, or a
    cast of it back to its captured dtype, with the captured value and that dtype. The
    node's own captured value then still holds (a re-run would rebuild it)."""
    if node.meta.get("val") is not node.meta.get("amp_orig_val"):
        return False
    back = {new: old for old, new in swap.items()}
    for a in input_nodes(node):  # all_input_nodes without its copy, same order
        orig = back.get(a, a)
        if orig is not a and not (a.meta.get("amp_cast") and a.args[0] is orig):
            return False  # a folded cast: the value of another node
        val = a.meta.get("val")
        if type(val) is not FakeTensor or val is not orig.meta.get("amp_orig_val") \
                or a.meta.get("amp_dtype", val.dtype) != val.dtype:
            return False
    return True


def _arg_key(a: Any) -> Any:
    """An argument as a re-run would see it: a node as its value's signature and dtype."""
    if isinstance(a, fx.Node):
        return (_sig(a.meta.get("val")), dtype_of(a))
    if isinstance(a, _SCALARS):
        return (type(a), a)
    if isinstance(a, (tuple, list)):
        return (type(a), tuple([_arg_key(v) for v in a]))
    raise _Unkeyable


def _val_sig(value: Any) -> Any:
    try:
        return _sig(value)
    except (_Unkeyable, TypeError):
        return None
