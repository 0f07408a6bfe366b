"""Periodic arguments: sin and cos of values no matrix product made stay fp32.

A periodic function keeps only its argument's phase, so its absolute error is the
argument's rounding error, which grows with the argument's magnitude, not the result's.
Sinusoidal timestep embeddings (diffusers' ``get_timestep_embedding``, in Flux, SD3, DiT
and every U-Net) compute ``sin/cos(t * freqs)`` of a float timestep up to ~1000: bf16
values there are 4 to 8 apart, so the phase is lost, and a 16-bit ``t * freqs`` gave the
time embedder's weight gradients a cosine of 0.93-0.98 with fp32's. NeRF-style positional
encodings (``sin(2**k * x)`` of coordinates) are the same computation. It is the rotary
angles' case (``passes/fx/index_values.py``) with a float input instead of an integer one.

torch.autocast keeps these in fp32 because their inputs never pass through one of its
lower-precision ops; O2 would paint them low (elementwise ops, low by default).
:func:`mark_periodic_arguments` forces to fp32 every ``sin``/``cos`` whose argument is
computed from graph inputs, parameters, buffers and constants through no allow-list op
(matrix product, convolution), with the elementwise and data-movement ops that make its
argument, back to those sources (through the model's explicit casts: a timestep's
``t[:, None].float()`` keeps its ``t[:, None]`` fp32). A sine of a linear's output (SIREN)
is left to the painter: the product already rounded its argument, as under autocast.
Applied where index values are (fp16/bf16 at O1 and O2); user op and module overrides win.
"""

from __future__ import annotations

from collections.abc import Hashable

import networkx as nx

from passes.paint import COMPUTE
from passes.policy import ALLOW, CLEAR, FORCED_GROUPS, FP32, INFER, NORM, LevelPolicy

PERIODIC = frozenset({"aten.sin", "aten.cos"})

REASON = ("periodic function of a value no matrix product made (a float timestep times "
          "frequencies, coordinates): its phase needs the argument's low bits, which 16 bits "
          "lose at magnitudes of hundreds (bf16 values from 512 to 1024 are 4 apart); kept fp32, "
          "as autocast keeps it")
ARGUMENT_REASON = ("makes the argument of a periodic function ({}): 16 bits would round "
                   "the phase away; kept fp32")


def mark_periodic_arguments(graph: nx.DiGraph, policy: LevelPolicy) -> int:
    """Force the periodic functions of ``graph`` whose arguments no allow-list op made, and
    the ops making those arguments, to fp32; return how many vertices were forced.

    Example:
        >>> mark_periodic_arguments(build_dataflow(gm), make_policy("O2"))  # sin, cos, mul
        3
    """
    nodes, pred = graph.nodes, graph.pred
    infos: dict[str, tuple[str, str]] = {}

    def info(v: Hashable) -> tuple[str, str]:
        op = nodes[v].get("op", "")
        hit = infos.get(op)
        if hit is None:
            i = policy.op_info(op)
            hit = infos[op] = (i.cls, i.group)
        return hit

    if not any(data.get("op") in PERIODIC for _, data in nodes(data=True)):
        return 0
    product_free: dict[Hashable, bool] = {}
    try:  # vertices are in the FX graph's order: producers first
        _product_free(graph, nodes, info, product_free)
    except KeyError:  # not in dataflow order after all
        _product_free(graph, nx.topological_sort(graph), info, product_free)
    forced = 0
    for v, data in nodes(data=True):
        if (data.get("op") not in PERIODIC or not product_free[v] or info(v)[0] != INFER
                or not _free(data, policy)):
            continue
        data["forced"] = (FP32, REASON)
        forced += 1
        stack, seen = list(pred[v]), set()
        while stack:  # the argument's ops, back to its sources
            u = stack.pop()
            if u in seen:
                continue
            seen.add(u)
            udata = nodes[u]
            if udata.get("kind", COMPUTE) != COMPUTE:  # an explicit cast: what it reads too
                stack.extend(pred[u])  # (x.view(...).float(): the view must not go low)
                continue
            if not product_free[u]:
                continue
            stack.extend(pred[u])
            cls, group = info(u)
            if (cls in (INFER, CLEAR) and group not in FORCED_GROUPS and group != NORM
                    and _free(udata, policy)):
                udata["forced"] = (FP32, ARGUMENT_REASON.format(v))
                forced += 1
    return forced


def _product_free(graph: nx.DiGraph, order, info, out: dict) -> None:
    """``out[v]``: no allow-list op on any path from a source to ``v`` (``v`` included);
    raises KeyError when ``order`` puts a vertex before one of its producers."""
    nodes, pred = graph.nodes, graph.pred
    for v in order:
        if nodes[v].get("kind", COMPUTE) != COMPUTE:
            out[v] = True  # a source: an input, weight, constant or explicit cast
        else:
            out[v] = info(v)[0] != ALLOW and all(out[u] for u in pred[v])


def _free(data: dict, policy: LevelPolicy) -> bool:
    """Neither forced already (a range hazard, an index value) nor under a module override."""
    if data.get("forced"):
        return False
    return not policy.overrides.modules or policy.overrides.module_precision(
        data.get("module", ""), data.get("module_classes", ())) is None


__all__ = ["ARGUMENT_REASON", "PERIODIC", "REASON", "mark_periodic_arguments"]
