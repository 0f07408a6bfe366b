"""Cast insertion and cast folding on an FX graph painted by ``passes.paint``.

Each painted node gets ``node.meta["amp_precision"]`` ("low" | "fp32" | "n/a") and
``node.meta["amp_reason"]``. ``insert_casts`` then makes every node's float inputs match
its precision: one cast per (producer, dtype) shared by all consumers, casts of
parameters and inputs hoisted to the top of the graph (once per forward, tied weights
once).

Dtypes are tracked in ``node.meta["amp_dtype"]`` (read it with :func:`dtype_of`;
``meta["val"]`` keeps the captured shapes). An op whose float inputs and outputs all had
one dtype in the captured graph follows its first float input; any other op is re-run on
fake tensors to learn its output dtype (``exact=True`` re-runs every op: slower, used by
tests to check the fast rule).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch.utils._pytree import tree_map

from passes._infra import ConstantRangeWarning, PassError, PassResult
from passes.fx.graph import FLOATS, explicit_cast_dtype, op_key, tensors
from passes.paint import Decision
from passes.policy import FP32, LOW, fixed_slots

CAST = torch.ops.aten._to_copy.default
KEEP = "keep"  # an input taken as it is


def is_amp_cast(node: Any) -> bool:
    return isinstance(node, fx.Node) and bool(node.meta.get("amp_cast"))


def dtype_of(node: Any) -> torch.dtype | None:
    """The dtype a node's (single) tensor output has after the rewrite so far."""
    if not isinstance(node, fx.Node):
        return None
    if "amp_dtype" in node.meta:
        return node.meta["amp_dtype"]
    ts = tensors(node.meta.get("val"))
    return ts[0].dtype if len(ts) == 1 else None


def _set_dtype(node: fx.Node, dtype: torch.dtype | None) -> None:
    if dtype is not None:
        node.meta["amp_dtype"] = dtype


def _orig_dtype(node: fx.Node) -> torch.dtype | None:
    return node.meta.get("amp_orig_dtype", dtype_of(node))


def mutated_slots(node: fx.Node) -> tuple[int, ...]:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload) or not t._schema.is_mutable:
        return ()
    return tuple(i for i, a in enumerate(t._schema.arguments)
                 if a.alias_info is not None and a.alias_info.is_write)


def required_dtype(node: fx.Node, slot: int | str, arg: fx.Node, low: torch.dtype) -> Any:
    """The dtype input ``arg`` (at position/kwarg ``slot``) must have, or KEEP.

    This one function decides for both cast insertion and verification.
    """
    orig = _orig_dtype(arg)
    if orig not in FLOATS or node.meta.get("amp_inserted"):
        return KEEP
    if explicit_cast_dtype(node) is not None or op_key(node) == "getitem":
        return KEEP
    mutated = mutated_slots(node)
    if mutated:
        if slot in mutated:
            return KEEP
        return dtype_of(node.args[mutated[0]]) or KEEP
    if slot in fixed_slots(op_key(node)):
        return orig
    precision = node.meta.get("amp_precision")
    if precision == LOW:
        return low
    if precision == FP32:
        return orig
    # n/a: integer/bool results do not depend on the input's rounding; others see originals.
    out = tensors(node.meta.get("amp_orig_val", node.meta.get("val")))
    if out and all(not t.is_floating_point() for t in out):
        return KEEP
    return orig


def _slots(node: fx.Node):
    """(slot, node) for every Node input, slots being arg index or kwarg name."""
    for i, a in enumerate(node.args):
        for n in _nodes_in(a):
            yield i, n
    for k, a in node.kwargs.items():
        for n in _nodes_in(a):
            yield k, n


def _nodes_in(value: Any) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    return []


class _Caster:
    """Creates and shares cast nodes: one per (producer, dtype)."""

    def __init__(self, gm: fx.GraphModule, fake_mode: Any):
        self.gm = gm
        self.fake_mode = fake_mode
        self.cache: dict[tuple[Any, torch.dtype], fx.Node] = {}
        self.anchor = _hoist_anchor(gm.graph)
        self.count = 0

    def _key(self, src: fx.Node) -> Any:
        if src.op == "get_attr":  # tied weights: one cast per tensor, not per name
            try:
                return id(_fetch_attr(self.gm, src.target))
            except AttributeError:
                return src
        return src

    def get(self, src: fx.Node, dtype: torch.dtype) -> fx.Node:
        # fold: cast(widen(x), dtype(x)) is x itself (low -> fp32 is exact).
        if (
            (is_amp_cast(src) or explicit_cast_dtype(src) is not None)
            and isinstance(src.args[0], fx.Node)
            and dtype_of(src.args[0]) == dtype
            and _widening(dtype, dtype_of(src))
        ):
            return src.args[0]
        key = (self._key(src), dtype)
        if key in self.cache:
            return self.cache[key]
        hoist = src.op in ("get_attr", "placeholder")
        value = src
        with self.gm.graph.inserting_after(self.anchor if hoist else src):
            bound = src.meta.get("amp_saturate")
            if bound is not None and dtype in (torch.float16, torch.bfloat16):
                value = self._saturate(src, dtype)
        with self.gm.graph.inserting_after(value):
            cast = self.gm.graph.call_function(CAST, (value,), {"dtype": dtype})
        cast.meta.update(amp_cast=True, amp_precision="n/a",
                         amp_reason=f"cast {dtype_of(src)} -> {dtype}")
        if "nn_module_stack" in src.meta:
            cast.meta["nn_module_stack"] = src.meta["nn_module_stack"]
        cast.meta["val"] = src.meta.get("val")  # shapes; the dtype is amp_dtype
        _set_dtype(cast, dtype)
        self.cache[key] = cast
        self.count += 1
        return cast


    def _saturate(self, src: fx.Node, dtype: torch.dtype) -> fx.Node:
        """Clamp a -inf stand-in (a mask fill beyond ``dtype``'s range) before casting."""
        limit = float(torch.finfo(dtype).max)
        value = self.gm.graph.call_function(torch.ops.aten.clamp.default, (src, -limit, limit))
        value.meta.update(
            val=src.meta.get("val"), amp_dtype=dtype_of(src), amp_precision="n/a",
            amp_inserted=True,
            amp_reason=f"range: clamp a mask fill to +-{limit:g} before the {dtype} cast "
                       "(exact for masking)")
        warnings.warn(
            f"ampgraph: {src.name} holds a mask fill ({src.meta['amp_saturate']:g} or lower) "
            f"beyond {dtype}'s range; it is clamped to -{limit:g} before the cast, which is "
            "exact for masking (exp underflows to 0 either way)",
            ConstantRangeWarning, stacklevel=2)
        return value


def _widening(low: torch.dtype, high: torch.dtype | None) -> bool:
    return high == torch.float32 and low in (torch.float16, torch.bfloat16)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _hoist_anchor(graph: fx.Graph) -> fx.Node:
    anchor = None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            anchor = node
    if anchor is None:
        raise PassError("insert_casts", None, "graph has no inputs or parameters")
    return anchor


def annotate(gm: fx.GraphModule, decisions: Mapping[str, Decision]) -> None:
    """Write the painter's decisions into ``node.meta`` (analysis only, no rewrite)."""
    for node in gm.graph.nodes:
        d = decisions.get(node.name)
        if d is not None:
            node.meta["amp_precision"] = d.precision
            node.meta["amp_reason"] = d.reason
        if "val" in node.meta and "amp_orig_val" not in node.meta:
            node.meta["amp_orig_val"] = node.meta["val"]
            node.meta["amp_orig_dtype"] = dtype_of(node)


def insert_casts(
    gm: fx.GraphModule, low: torch.dtype, *, keep_io_types: bool = True, exact: bool = False,
    recompile: bool = True,
) -> PassResult:
    """Insert the casts that make every node's inputs match ``node.meta["amp_precision"]``.

    Args:
        gm: a graph annotated by :func:`annotate`.
        low: the low-precision dtype (torch.bfloat16 or torch.float16).
        keep_io_types: cast float outputs back to their original dtype.
        exact: learn every op's output dtype by running it on fake tensors.
        recompile: regenerate ``gm.forward`` (a pipeline recompiles once at its end).

    Example:
        >>> annotate(gm, paint(build_dataflow(gm), policy)); insert_casts(gm, torch.bfloat16)
    """
    graph = gm.graph
    fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes])
    if fake_mode is None:
        raise PassError("insert_casts", None, "nodes carry no fake-tensor metadata; capture "
                        "the model with torch.export first")
    caster = _Caster(gm, fake_mode)
    for node in graph.nodes:
        _set_dtype(node, dtype_of(node))
    for node in list(graph.nodes):
        if node.op == "output":
            if keep_io_types:
                _cast_outputs(node, caster)
            continue
        if node.op != "call_function" or is_amp_cast(node):
            continue
        changed = False
        replace: dict[tuple[Any, fx.Node], fx.Node] = {}
        for slot, arg in _slots(node):
            want = required_dtype(node, slot, arg, low)
            if want is not KEEP and dtype_of(arg) != want and dtype_of(arg) in FLOATS:
                replace[(slot, arg)] = caster.get(arg, want)
        if replace:
            node.args = tuple(_swap(a, i, replace) for i, a in enumerate(node.args))
            node.kwargs = {k: _swap(a, k, replace) for k, a in node.kwargs.items()}
            changed = True
        if changed or node.meta.get("amp_precision") == LOW:
            _propagate_dtype(node, fake_mode, exact)
    if recompile:
        gm.recompile()
    gm.meta["amp_casts"] = gm.meta.get("amp_casts", 0) + caster.count
    return PassResult(gm, caster.count > 0)


def _swap(value: Any, slot: Any, replace: Mapping) -> Any:
    if isinstance(value, fx.Node):
        return replace.get((slot, value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, slot, replace) for v in value)
    return value


def _cast_outputs(node: fx.Node, caster: _Caster) -> None:
    def back(v: Any) -> Any:
        if isinstance(v, fx.Node):
            orig, cur = _orig_dtype(v), dtype_of(v)
            if orig in FLOATS and cur in FLOATS and orig != cur:
                return caster.get(v, orig)
        return v

    node.args = tree_map(back, node.args)


def _follows_inputs(node: fx.Node) -> bool:
    """In the captured graph, all float inputs and outputs of ``node`` had one dtype."""
    dtypes = {t.dtype for t in tensors(node.meta.get("amp_orig_val")) if t.is_floating_point()}
    for a in node.all_input_nodes:
        dtypes |= {t.dtype for t in tensors(a.meta.get("amp_orig_val", a.meta.get("val")))
                   if t.is_floating_point()}
    return len(dtypes) == 1 and not any(isinstance(v, torch.dtype)
                                        for v in (*node.args, *node.kwargs.values()))


def _propagate_dtype(node: fx.Node, fake_mode: Any, exact: bool) -> None:
    if not exact and _follows_inputs(node) and len(tensors(node.meta.get("val"))) == 1:
        first = next((a for _, a in _slots(node) if dtype_of(a) in FLOATS), None)
        if first is not None:
            _set_dtype(node, dtype_of(first))
            return

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
        raise PassError("insert_casts", node.name,
                        f"could not re-run {op_key(node)} on the new dtypes: {exc}") from exc
    node.meta.pop("amp_dtype", None)
    _set_dtype(node, dtype_of(node))


def fold_casts(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Fold cast chains: casts to the producer's own dtype vanish, ``low -> fp32 -> low``
    becomes the original low value. ``fp32 -> low -> fp32`` is kept: it changes values.
    """
    modified = False
    for node in list(gm.graph.nodes):
        if not is_amp_cast(node):
            continue
        src = node.args[0]
        target = node.kwargs["dtype"]
        if dtype_of(src) == target:
            node.replace_all_uses_with(src)
            gm.graph.erase_node(node)
            modified = True
        elif is_amp_cast(src) and dtype_of(src.args[0]) == target and _widening(
            target, dtype_of(src)
        ):
            node.replace_all_uses_with(src.args[0])
            gm.graph.erase_node(node)
            modified = True
    for node in list(gm.graph.nodes):
        if is_amp_cast(node) and not node.users:
            gm.graph.erase_node(node)
            modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


def count_casts(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if is_amp_cast(n))
