"""``torch.autocast(enabled=False)`` regions of a model, recorded by torch.export as
``wrap_with_autocast`` calls, inlined into the graph and kept fp32.

A model that turns autocast off around a computation says that computation must run in
fp32 (timm's EfficientViT attention, rotary and norm code in many models): under
``torch.autocast`` it does. The higher-order op is inlined so the AMP passes see plain aten
ops (they cannot re-run the op on new dtypes), each inlined op tagged; after the dataflow
graph is built, :func:`force_autocast_off` keeps the tagged ops fp32.
"""

from __future__ import annotations

import networkx as nx
import torch
from torch import fx

from passes._infra import visiting
from passes.fx.no_grad_regions import inline_region
from passes.paint import force_fp32

AUTOCAST_OFF = "inside torch.autocast(enabled=False) in the model: fp32, as under autocast"


def inline_autocast_off_regions(gm: fx.GraphModule) -> int:
    """Inline every ``wrap_with_autocast(device, dtype, False, cache, body, *inputs)`` call
    of ``gm`` and of the regions it holds (a ``no_grad`` body, another autocast region),
    tagging each inlined op ``node.meta["amp_autocast_off"]``. Regions that turn autocast
    on, and bodies with attributes of their own, are left as they are. Returns the number
    of calls inlined.

    Example:
        >>> inline_autocast_off_regions(torch.export.export(model, args).module())  # doctest: +SKIP
        1
    """
    hop = getattr(torch.ops.higher_order, "wrap_with_autocast", None)
    for sub in gm.children():
        if isinstance(sub, fx.GraphModule):
            inline_autocast_off_regions(sub)
    inlined = 0
    for node in visiting(list(gm.graph.nodes)):
        if node.op != "call_function" or node.target is not hop or len(node.args) < 5 \
                or node.args[2] is not False:
            continue
        body_node = node.args[4]
        if getattr(body_node, "op", None) != "get_attr":
            continue
        copies = inline_region(gm, node, body_node, node.args[5:])
        if copies is None:
            continue
        for copy in copies:
            copy.meta["amp_autocast_off"] = True
        inlined += 1
    if inlined:
        gm.graph.lint()
        gm.recompile()
    return inlined


def force_autocast_off(graph: nx.DiGraph, gm: fx.GraphModule) -> None:
    """Keep fp32 the dataflow vertices of the ops :func:`inline_autocast_off_regions`
    tagged (unless another hazard forced them already)."""
    for node in gm.graph.nodes:
        if node.meta.get("amp_autocast_off"):
            force_fp32(graph, node.name, AUTOCAST_OFF)
