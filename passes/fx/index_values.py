"""Index values: float data computed only from buffers, constants and integer inputs.

Rotary position embeddings compute ``cos/sin(positions x inv_freq)``: a matmul of an fp32
buffer with positions cast from integers. Run in bf16 (8 significant bits), the angle at
position 1000 is off by several radians, so every rotated query and key is wrong; HF's
LLaMA, Qwen2 and Mistral switch autocast off around that product for this reason, and the
switch is not in the exported graph. Other values of this kind (causal and padding masks,
ALiBi slopes, sinusoidal tables) are just as cheap: they do not depend on the batch's float
data or on any parameter, and they are computed once per forward.

:func:`mark_index_values` forces every compute vertex whose float inputs all come from
buffers, constants, tensor factories or integer inputs (transitively) to fp32, with a
reason ``explain`` shows. Values derived from a float graph input or a parameter are left
to the painter. Not applied at O0 (all fp32 anyway) or O3 (everything low, by definition).
"""

from __future__ import annotations

import networkx as nx
from torch import fx

from passes._infra import visiting
from passes.paint import COMPUTE
from passes.policy import FP32

REASON = ("computed only from buffers, constants and integer inputs (positions, masks, "
          "rotary angles): kept fp32, cheap and precision-sensitive")


def mark_index_values(graph: nx.DiGraph, gm: fx.GraphModule) -> int:
    """Force index values to fp32 in the painter's ``graph``; return how many were forced.

    Example:
        >>> mark_index_values(build_dataflow(gm), gm)   # a LLaMA: the rotary matmul, cos, sin
        7
    """
    parameters = {name for name, _ in gm.named_parameters()}
    data_free: dict[str, bool] = {}  # vertex -> no float graph input or parameter upstream
    pred, attrs = graph.pred, graph.nodes
    forced = 0
    for node in visiting(gm.graph.nodes):
        name = node.name
        if name not in pred:
            continue
        if node.op == "placeholder":
            data_free[name] = False
            continue
        if node.op == "get_attr":
            data_free[name] = node.target not in parameters
            continue
        free = all(data_free.get(p, False) for p in pred[name])
        data_free[name] = free
        data = attrs[name]
        if free and data.get("kind") == COMPUTE and not data.get("forced"):
            data["forced"] = (FP32, REASON)
            forced += 1
    return forced
