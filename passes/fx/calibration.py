"""Calibration: activations a sample run shows the low dtype cannot hold, kept fp32.

Constants out of range are found before painting (``hazards.py``); activations are known
only once the model runs. A VAE decoder's weights can make a convolution's output, and the
residual sum after it, reach 1e5-1e6 while the GroupNorm after them brings values back to
O(1): in fp16 (largest finite 65504) those values turn to inf, then NaN. A calibration run
executes the captured graph in fp32 on sample inputs (:func:`observe_magnitudes`, before
any rewrite), records each op's largest |output| and largest |input|, and
:func:`overflowing` names the ops where either exceeds the low dtype's largest finite value
divided by :data:`HEADROOM`. Those keys travel in the policy (``LevelPolicy.calibrated``);
the pipeline's first pass, :func:`tag_calibrated`, writes their reasons into ``node.meta``
of a new capture, and :func:`force_calibrated`, after the range hazards, keeps them fp32.

Ops are keyed by (module path, op key, occurrence of that pair in the graph), computed on
the graph as ``torch.export`` gives it (:func:`node_keys`), so a key names the same op in
every capture of the model whatever the input shapes or graph names.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import networkx as nx
import torch
from torch import fx

from passes.fx.hazards import low_range
from passes.fx.nodes import SHORT_NAMES, module_info, op_key, tensors
from passes.paint import force_fp32

HEADROOM = 4.0  # marked above finfo(low).max / HEADROOM: other inputs may reach further

__all__ = ["HEADROOM", "force_calibrated", "node_keys", "observe_magnitudes", "overflowing",
           "tag_calibrated"]


def node_keys(gm: fx.GraphModule) -> dict[fx.Node, str]:
    """``"module.path:aten.op#i"`` for every op of ``gm``: the i-th op of that key in that
    module, in graph order.

    Example:
        >>> node_keys(gm)[conv_node]
        'mid.conv1:aten.conv2d#0'
    """
    counts: dict[str, int] = {}
    keys: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        base = f"{module_info(node)[0]}:{op_key(node)}"
        i = counts.get(base, 0)
        counts[base] = i + 1
        keys[node] = f"{base}#{i}"
    return keys


def _max_abs(value: Any) -> float:
    best = 0.0
    for t in tensors(value):
        if t.is_floating_point() and t.numel():
            m = float(t.detach().abs().max())
            best = m if math.isnan(m) else max(best, m)
    return best


class _Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule):
        super().__init__(gm, garbage_collect_values=True)
        self.largest: dict[fx.Node, float] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        self.largest[n] = _max_abs(result)
        return result


def observe_magnitudes(gm: fx.GraphModule, args: tuple, kwargs: dict) -> dict[str, tuple]:
    """Run ``gm`` (as captured, its pytree calling convention) on ``(args, kwargs)`` and
    return key -> (largest |output|, largest |input|) for every op (see :func:`node_keys`).

    Example:
        >>> observe_magnitudes(captured.gm, (x,), {})["mid.conv1:aten.conv2d#0"]
        (312000.0, 4.1)
    """
    recorder = _Recorder(gm)
    with torch.no_grad():
        recorder.run(*gm.graph.process_inputs(args, kwargs))
    largest = recorder.largest
    out: dict[str, tuple] = {}
    for node, key in node_keys(gm).items():
        inputs = [largest.get(a, 0.0) for a in node.all_input_nodes]
        out[key] = (largest.get(node, 0.0), max(inputs, default=0.0))
    return out


def overflowing(magnitudes: Mapping[str, tuple], low: torch.dtype,
                headroom: float = HEADROOM) -> dict[str, str]:
    """Key -> reason for each op whose output or input exceeds ``low``'s largest finite
    value / ``headroom`` (none for bf16 in practice: it has fp32's exponent range).

    Example:
        >>> overflowing({"conv:aten.conv2d#0": (3.2e5, 4.0)}, torch.float16)
        {'conv:aten.conv2d#0': "calibration: max |output| = 3.2e+05 on the sample ..."}
    """
    if low not in (torch.float16, torch.bfloat16):
        return {}
    big = low_range(low)[0]
    limit = big / headroom
    name = SHORT_NAMES[low]
    found: dict[str, str] = {}
    for key, (out, inp) in magnitudes.items():
        which, value = ("output", out) if not out <= inp else ("input", inp)
        if not value <= limit:  # NaN counts: the fp32 run itself overflowed there
            found[key] = (f"calibration: max |{which}| = {value:.3g} on the sample inputs "
                          f"exceeds {name}'s range ({big:g}) / {headroom:g}: kept fp32")
    return found


def tag_calibrated(gm: fx.GraphModule, calibrated: Mapping[str, str]) -> int:
    """Write ``node.meta["amp_calibrated"]`` (the reason) on each op ``calibrated`` names.
    Run on the graph as captured, before any pass changes it; returns how many."""
    count = 0
    for node, key in node_keys(gm).items():
        reason = calibrated.get(key)
        if reason is not None:
            node.meta["amp_calibrated"] = reason
            count += 1
    return count


def force_calibrated(graph: nx.DiGraph, gm: fx.GraphModule) -> None:
    """Keep fp32 the dataflow vertices of the ops :func:`tag_calibrated` marked (unless
    another hazard forced them already)."""
    for node in gm.graph.nodes:
        reason = node.meta.get("amp_calibrated")
        if reason:
            force_fp32(graph, node.name, reason)
