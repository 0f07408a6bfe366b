"""Range hazards: constants the low dtype cannot hold, found before painting.

fp16 holds magnitudes from 2**-24 to 65504; bf16 has fp32's exponent range but its largest
value (3.3895e38) is below fp32's (3.4028e38), so ``torch.finfo(torch.float32).min`` as a
mask fill does not fit either. A constant outside the range changes meaning when its op
runs low: ``masked_fill(x, m, -1e9)`` writes -inf in fp16 (a fully masked softmax row turns
to NaN), ``x + 1e-9`` adds zero, ``x * 1e5`` overflows. This analysis

- keeps the op that holds such a constant in fp32 (vertex attribute ``forced``);
- marks a value whose out-of-range constants are all large negative fills (a -inf stand-in
  for masking) as ``saturate``: casting it to the low dtype clamps to the dtype's lowest
  finite value first, which is exact for masking (exp underflows to 0 either way) and keeps
  fully masked rows finite; a :class:`ConstantRangeWarning` says so;
- keeps the consumers of a too-small constant's op in fp32, and everything downstream of a
  too-large constant until a normalising op (norm, softmax) brings values back in range.
"""

from __future__ import annotations

import math
from typing import Any

import networkx as nx
import torch
from torch import fx

from passes._infra import ConstantRangeWarning, visiting
from passes.fx.nodes import SHORT_NAMES, op_key
from passes.paint import force_fp32

# Norm kernels add eps inside an fp32 (opmath) accumulation even for fp16 inputs, so a tiny
# eps (BERT's 1e-12) is not a hazard there; they also bring values back into range.
FP32_ACCUMULATING = frozenset(
    "aten.layer_norm aten.native_layer_norm aten.batch_norm aten.native_batch_norm "
    "aten._native_batch_norm_legit aten._native_batch_norm_legit_functional "
    "aten._native_batch_norm_legit_no_training aten.group_norm aten.native_group_norm "
    "aten.instance_norm aten.rms_norm aten._fused_rms_norm".split()
)
NORMALISING = FP32_ACCUMULATING | {"aten.softmax", "aten._softmax", "aten.log_softmax",
                                   "aten._log_softmax", "aten._safe_softmax"}

__all__ = ["ConstantRangeWarning", "mark_range_hazards", "low_range"]


def low_range(dtype: torch.dtype) -> tuple[float, float]:
    """(largest finite magnitude, smallest non-zero magnitude) of a low dtype."""
    info = torch.finfo(dtype)
    return float(info.max), float(info.smallest_normal) * 2.0 ** -(info.bits - 1 - _exp_bits(
        dtype))


def _exp_bits(dtype: torch.dtype) -> int:
    return {torch.float16: 5, torch.bfloat16: 8}[dtype]


_PACKETS: dict[str, str] = {}


def _packet(node: fx.Node) -> str:
    key = op_key(node)
    packet = _PACKETS.get(key)
    if packet is None:
        packet = ".".join(key.split(".")[:2])
        if len(_PACKETS) < 4096:  # op keys: a small set
            _PACKETS[key] = packet
    return packet


def _out_of_range(v: Any, big: float, tiny: float) -> bool:
    if isinstance(v, bool) or not isinstance(v, float) or math.isnan(v) or math.isinf(v):
        return False  # inf/nan already mean the same in every float dtype
    return abs(v) > big or (v != 0.0 and abs(v) < tiny)


def _scalars(node: fx.Node, big: float, tiny: float) -> list[float]:
    out: list[float] = []
    for a in node.args:
        if isinstance(a, _WALKED):  # the common case: an input or an int, nothing to walk
            _walk(a, big, tiny, out)
    for a in node.kwargs.values():
        if isinstance(a, _WALKED):
            _walk(a, big, tiny, out)
    if out and _packet(node) in FP32_ACCUMULATING:
        return []
    return out


_WALKED = (float, list, tuple)  # what _walk looks into


def _walk(a: Any, big: float, tiny: float, out: list[float]) -> None:
    """Append the out-of-range floats in ``a`` (nested lists/tuples) to ``out``.

    A module-level function: a recursive closure is a reference cycle per call, garbage
    only the cycle collector frees (one per node of a large graph).
    """
    if isinstance(a, (list, tuple)):
        for x in a:
            _walk(x, big, tiny, out)
    elif isinstance(a, float) and _out_of_range(a, big, tiny):
        out.append(a)


def _tensor_constant(gm: fx.GraphModule, node: fx.Node, big: float, tiny: float) -> list[float]:
    if node.op != "get_attr":
        return []
    try:
        value = gm.get_buffer(node.target)
    except AttributeError:
        value = getattr(gm, node.target, None)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return []
    if not value.is_floating_point() or value.numel() == 0 or value.is_meta:
        return []
    finite = value[torch.isfinite(value)].double()
    bad = finite[(finite.abs() > big) | ((finite != 0) & (finite.abs() < tiny))]
    return [float(bad.min()), float(bad.max())] if bad.numel() else []


def mark_range_hazards(graph: nx.DiGraph, gm: fx.GraphModule, low: torch.dtype) -> dict:
    """Annotate ``graph`` (and ``node.meta``) with ``low``'s range hazards.

    Returns:
        node name -> reason, for every node holding an out-of-range constant.

    Example:
        >>> hazards = mark_range_hazards(build_dataflow(gm), gm, torch.float16)
    """
    big, tiny = low_range(low)
    name = SHORT_NAMES[low]
    found: dict[str, str] = {}

    def force(node: fx.Node, reason: str) -> None:
        force_fp32(graph, node.name, reason)

    for node in visiting(list(gm.graph.nodes)):
        op = node.op
        if op == "call_function":
            values = _scalars(node, big, tiny)
        elif op == "get_attr":
            values = _tensor_constant(gm, node, big, tiny)
        else:
            continue
        if not values or node.name not in graph:
            continue
        shown = ", ".join(f"{v:g}" for v in sorted(set(values))[:3])
        reason = f"{name} range: constant {shown} is outside {name}'s range"
        force(node, reason + ", kept fp32")
        found[node.name] = reason
        if all(v <= -big for v in values):  # a -inf stand-in: clamp when cast down
            node.meta["amp_saturate"] = min(values)
            continue
        if all(abs(v) < tiny for v in values):  # a vanishing epsilon: its readers stay fp32
            for user in node.users:
                force(user, f"{name} range: reads {node.name} ({shown}), kept fp32")
            continue
        # a large value: everything downstream stays fp32 until a normalising op
        stack, seen = list(node.users), set()
        while stack:
            user = stack.pop()
            if user in seen:
                continue
            seen.add(user)
            force(user, f"{name} range: downstream of {node.name} ({shown}), kept fp32")
            if _packet(user) not in NORMALISING:
                stack.extend(user.users)
    return found
