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

A matrix product (an allow-list op) of float buffers alone, with no integer value or tensor
factory upstream (``linalg.multi_dot`` of a module's constant matrices), is no index value:
it is left to the painter, which runs it low as torch.autocast does. A product of positions
and frequencies (the rotary angles) has integers or a factory upstream and stays fp32.
"""

from __future__ import annotations

import networkx as nx
from torch import fx

from passes._infra import visiting
from passes.paint import NONFLOAT, force_fp32
from passes.policy import ALLOW, LevelPolicy

REASON = ("computed only from buffers, constants and integer inputs (positions, masks, "
          "rotary angles): kept fp32, cheap and precision-sensitive")


def mark_index_values(graph: nx.DiGraph, gm: fx.GraphModule,
                      policy: LevelPolicy | None = None) -> int:
    """Force index values to fp32 in the painter's ``graph``; return how many were forced.

    Args:
        graph: the painter's dataflow graph of ``gm``.
        gm: the graph module, for its parameters and its nodes' inputs.
        policy: when given, its allow-list ops computed from float buffers alone (no
            integer value or factory upstream) are left to the painter.

    Example:
        >>> mark_index_values(build_dataflow(gm), gm)   # a LLaMA: the rotary matmul, cos, sin
        7
    """
    parameters = {name for name, _ in gm.named_parameters()}
    data_free: dict[str, bool] = {}  # vertex -> no float graph input or parameter upstream
    buffers_only: dict[str, bool] = {}  # vertex -> computed from float buffers alone
    pred, attrs = graph.pred, graph.nodes
    forced = 0
    for node in visiting(gm.graph.nodes):
        name = node.name
        if name not in pred:
            continue
        data = attrs[name]
        if node.op == "placeholder":
            data_free[name] = buffers_only[name] = False
            continue
        if node.op == "get_attr":
            data_free[name] = node.target not in parameters
            buffers_only[name] = data_free[name] and data.get("kind") != NONFLOAT
            continue
        free = all(data_free.get(p, False) for p in pred[name])
        data_free[name] = free
        if free:  # every input counts, integer ones too: positions make an index value
            inputs = node.all_input_nodes
            only = buffers_only[name] = bool(inputs) and all(
                buffers_only.get(a.name, False) for a in inputs)
            if only and policy is not None and policy.op_info(data.get("op", "")).cls == ALLOW:
                continue  # a product of the module's constant matrices: the allow list's
        if free and force_fp32(graph, name, REASON):
            forced += 1
    return forced
