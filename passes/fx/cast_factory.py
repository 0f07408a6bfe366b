"""The cast factory of cast insertion: one cast node per (producer, dtype), shared.

Casts of parameters and graph inputs are hoisted to the top of the graph (once per
forward; tied weights, one tensor under two names, once), a cast of a widening cast back to
its source's dtype is the source itself, and a mask fill beyond the low dtype's range is
clamped before it is cast (``meta["amp_saturate"]``, set by ``passes.fx.hazards``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import fx

from passes._infra import ConstantRangeWarning, PassError
from passes.fx._torch_internals import CAN_RELINK, cast_node_name, create_node_hooks, relink
from passes.fx.dtypes import CAST, dtype_of, is_widening, set_dtype
from passes.fx.nodes import explicit_cast_dtype, fetch_attr


class Caster:
    """Creates and shares cast nodes: one per (producer, dtype).

    Example:
        >>> caster = Caster(gm, graph_fake_mode(list(gm.graph.nodes)))
    """

    def __init__(self, gm: fx.GraphModule, fake_mode: Any):
        self.gm = gm
        self.fake_mode = fake_mode
        # dtype -> producer key -> its cast. Nested, not keyed by (producer, dtype) pairs: a
        # pair per cast would be ~6% more objects that outlive the pass on a large graph.
        self.cache: dict[torch.dtype, dict[Any, fx.Node]] = {}
        self._attr_keys: dict[fx.Node, Any] = {}  # get_attr node -> its tensor's id
        self._reasons: dict[tuple[Any, torch.dtype], str] = {}
        self.anchor = _hoist_anchor(gm.graph)
        self.count = 0
        # the name create_node derives from the target, worked out once ("_to_copy_default")
        self.name = _cast_name(gm.graph)
        # nodes may get their args after creation unless a create-node hook wants to see them
        self.fast = CAN_RELINK and not create_node_hooks(gm)

    def _key(self, src: fx.Node) -> Any:
        if src.op == "get_attr":  # tied weights: one cast per tensor, not per name
            key = self._attr_keys.get(src)
            if key is None:
                try:
                    key = id(fetch_attr(self.gm, src.target))
                except AttributeError:
                    key = src
                self._attr_keys[src] = key
            return key
        return src

    def get(self, src: fx.Node, dtype: torch.dtype) -> fx.Node:
        src_meta = src.meta
        # fold: cast(widen(x), dtype(x)) is x itself (low -> fp32 is exact).
        if src_meta.get("amp_cast") or explicit_cast_dtype(src) is not None:
            inner = src.args[0]
            if (isinstance(inner, fx.Node) and dtype_of(inner) == dtype
                    and is_widening(dtype, dtype_of(src))):
                return inner
        key = self._key(src)
        casts = self.cache.get(dtype)
        if casts is None:
            casts = self.cache[dtype] = {}
        cast = casts.get(key)
        if cast is not None:
            return cast
        graph = self.gm.graph
        value = src
        if src_meta.get("amp_saturate") is not None and dtype in (torch.float16, torch.bfloat16):
            hoist = src.op in ("get_attr", "placeholder")
            with graph.inserting_after(self.anchor if hoist else src):
                value = self._saturate(src, dtype)
        with graph.inserting_after(value):
            if self.fast:
                # Args set after creation: create_node's scan of them for raw symbolic
                # values costs more than the rest of the node; ours are a node and a dtype.
                cast = graph.create_node("call_function", CAST, name=self.name)
                relink(cast, (value,), {"dtype": dtype})
            else:
                cast = graph.create_node("call_function", CAST, (value,), {"dtype": dtype},
                                         name=self.name)
        src_dtype = dtype_of(src)
        reason = self._reasons.get((src_dtype, dtype))
        if reason is None:
            reason = self._reasons[(src_dtype, dtype)] = f"cast {src_dtype} -> {dtype}"
        meta = cast.meta
        meta["amp_cast"] = True
        meta["amp_precision"] = "n/a"
        meta["amp_reason"] = reason
        if "nn_module_stack" in src_meta:
            meta["nn_module_stack"] = src_meta["nn_module_stack"]
        meta["val"] = src_meta.get("val")  # shapes; the dtype is amp_dtype
        set_dtype(cast, dtype)
        casts[key] = cast
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


def _cast_name(graph: fx.Graph) -> str | None:
    """The name candidate create_node derives for a cast ("_to_copy_default"), or None (let
    it derive it). Worked out once; given sanitised, create_node skips a regex rewrite."""
    return cast_node_name(graph, CAST)


def _hoist_anchor(graph: fx.Graph) -> fx.Node:
    anchor = None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            anchor = node
    if anchor is None:
        raise PassError("insert_casts", None, "graph has no inputs or parameters")
    return anchor
