"""fp16 range hazards: constants fp16 cannot hold, found before painting.

fp16 holds magnitudes from 2**-24 to 65504. A constant outside that range changes meaning
when an op runs in fp16: ``masked_fill(x, m, -1e9)`` writes -inf (a fully masked softmax row
turns to NaN), ``x + 1e-8`` adds zero, ``x * 1e5`` overflows. bf16 has fp32's range: no
hazard. For fp16 this analysis

- keeps the op that holds such a constant in fp32 (vertex attribute ``forced``);
- marks a value whose out-of-range constants are all large negative fills (a -inf stand-in
  for masking) as ``saturate``: casting it to fp16 clamps to -65504 first, which is exact
  for masking (exp underflows to 0 either way) and keeps fully masked rows finite;
- keeps the direct consumers of any other out-of-range value in fp32 too.
"""

from __future__ import annotations

import math
from typing import Any

import networkx as nx
import torch
from torch import fx

from passes.fx.graph import op_key
from passes.paint import COMPUTE
from passes.policy import FP32

FP16_MAX = 65504.0
FP16_TINY = 2.0**-24  # smallest fp16 subnormal: anything smaller becomes 0


def _out_of_range(v: Any) -> bool:
    if isinstance(v, bool) or not isinstance(v, float):
        return False
    if math.isnan(v) or math.isinf(v):
        return False  # already inf/nan in fp32: fp16 keeps the meaning
    return abs(v) > FP16_MAX or (v != 0.0 and abs(v) < FP16_TINY)


# Norm kernels add eps inside an fp32 (opmath) accumulation even for fp16 inputs, so a tiny
# eps (BERT's 1e-12) is not a hazard there.
FP32_ACCUMULATING = frozenset(
    "aten.layer_norm aten.native_layer_norm aten.batch_norm aten.native_batch_norm "
    "aten._native_batch_norm_legit aten._native_batch_norm_legit_functional "
    "aten._native_batch_norm_legit_no_training aten.group_norm aten.native_group_norm "
    "aten.instance_norm aten.rms_norm aten._fused_rms_norm".split()
)


def _scalars(node: fx.Node) -> list[float]:
    out: list[float] = []
    if ".".join(op_key(node).split(".")[:2]) in FP32_ACCUMULATING:
        return out

    def walk(a: Any) -> None:
        if isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif _out_of_range(a):
            out.append(a)

    walk(node.args)
    walk(tuple(node.kwargs.values()))
    return out


def _tensor_constant(gm: fx.GraphModule, node: fx.Node) -> list[float]:
    if node.op != "get_attr":
        return []
    try:
        value = gm.get_buffer(node.target) if "." in node.target or hasattr(gm, node.target) \
            else None
    except AttributeError:
        value = getattr(gm, node.target, None)
    if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
        return []
    if not value.is_floating_point() or value.numel() == 0 or value.device.type == "meta":
        return []
    finite = value[torch.isfinite(value)].float()
    bad = finite[(finite.abs() > FP16_MAX) | ((finite != 0) & (finite.abs() < FP16_TINY))]
    return [float(bad.min()), float(bad.max())] if bad.numel() else []


def mark_fp16_hazards(graph: nx.DiGraph, gm: fx.GraphModule) -> dict[str, str]:
    """Annotate ``graph`` (and ``node.meta``) with fp16 range hazards; return name -> reason.

    Example:
        >>> hazards = mark_fp16_hazards(build_dataflow(gm), gm)
    """
    found: dict[str, str] = {}
    for node in gm.graph.nodes:
        values = _scalars(node) if node.op == "call_function" else _tensor_constant(gm, node)
        if not values or node.name not in graph:
            continue
        shown = ", ".join(f"{v:g}" for v in sorted(set(values))[:3])
        mask_fill = all(v <= -FP16_MAX for v in values)
        reason = f"fp16 range: constant {shown} is outside fp16's range"
        if graph.nodes[node.name].get("kind") == COMPUTE:
            graph.nodes[node.name]["forced"] = (FP32, reason + ", kept fp32")
        found[node.name] = reason
        if mask_fill:
            node.meta["amp_saturate"] = True  # a -inf stand-in: clamp when cast to fp16
            continue
        for user in node.users:
            if user.name in graph and graph.nodes[user.name].get("kind") == COMPUTE:
                graph.nodes[user.name]["forced"] = (
                    FP32, f"fp16 range: consumes {node.name} ({shown}), kept fp32")
    return found
