"""Dtype metadata of a rewritten FX graph: what each node holds now, and held at capture.

Dtypes are tracked in ``node.meta["amp_dtype"]`` (read it with :func:`dtype_of`;
``meta["val"]`` keeps the captured shapes), the captured dtype in
``meta["amp_orig_dtype"]`` (written by ``passes.fx.insert_casts.annotate``). Casts the
passes insert are ``aten._to_copy`` nodes marked ``meta["amp_cast"]``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from passes.fx.nodes import tensors

CAST = torch.ops.aten._to_copy.default


def is_amp_cast(node: Any) -> bool:
    """Whether ``node`` is a cast the passes inserted.

    Example:
        >>> [n for n in gm.graph.nodes if is_amp_cast(n)]
    """
    return isinstance(node, fx.Node) and bool(node.meta.get("amp_cast"))


def dtype_of(node: Any) -> torch.dtype | None:
    """The dtype a node's (single) tensor output has after the rewrite so far.

    Example:
        >>> dtype_of(linear_node)
        torch.bfloat16
    """
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta
    if "amp_dtype" in meta:
        return meta["amp_dtype"]
    val = meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    ts = tensors(val)
    return ts[0].dtype if len(ts) == 1 else None


def set_dtype(node: fx.Node, dtype: torch.dtype | None) -> None:
    """Record ``dtype`` as what ``node`` now outputs (``meta["amp_dtype"]``); None: nothing.

    Example:
        >>> set_dtype(cast_node, torch.bfloat16); dtype_of(cast_node)
        torch.bfloat16
    """
    if dtype is not None:
        node.meta["amp_dtype"] = dtype


def orig_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype ``node`` output in the captured graph (``meta["amp_orig_dtype"]``), or its
    current one where none was recorded.

    Example:
        >>> orig_dtype(linear_node)  # painted low, captured in fp32
        torch.float32
    """
    meta = node.meta
    return meta["amp_orig_dtype"] if "amp_orig_dtype" in meta else dtype_of(node)


def is_widening(low: torch.dtype, high: torch.dtype | None) -> bool:
    """Whether a cast from ``low`` to ``high`` is exact: fp16 or bf16 to fp32.

    Example:
        >>> is_widening(torch.bfloat16, torch.float32), is_widening(torch.float32, torch.float16)
        (True, False)
    """
    return high == torch.float32 and low in (torch.float16, torch.bfloat16)


NO_FLOATS: frozenset = frozenset()  # what float_dtypes gives a value without float tensors


_DTYPE_SETS: dict[torch.dtype, frozenset] = {}  # dtype -> {dtype} if floating, else {}


def float_dtypes(value: Any) -> frozenset:
    """The floating-point dtypes of the tensors in a meta value (one shared set per dtype for
    a single tensor).

    Example:
        >>> float_dtypes((torch.zeros(1), torch.zeros(1, dtype=torch.int64)))
        frozenset({torch.float32})
    """
    if isinstance(value, torch.Tensor):
        dtype = value.dtype
        found = _DTYPE_SETS.get(dtype)
        if found is None:
            found = _DTYPE_SETS[dtype] = (frozenset((dtype,)) if dtype.is_floating_point
                                          else NO_FLOATS)
        return found
    return frozenset(t.dtype for t in tensors(value) if t.is_floating_point())
