"""What running a graph costs, as both dialects' analyses report it.

``passes.fx.costs.graph_costs`` (a rewritten FX graph, sizes from its fake tensors) and
``passes.onnx.costs.model_costs`` (a converted ONNX model, sizes from shape inference)
return the same :class:`GraphCosts`, so the two targets of ``ampgraph inspect`` print the
same summary.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GraphCosts:
    """FLOPs and bytes of one forward at the shapes the sizes were taken at.

    Attributes:
        flops: FLOPs (2 x multiply-adds) of the matmul, convolution and attention nodes.
        low_flops: the part of ``flops`` in nodes that run in the low (16-bit) dtype.
        param_bytes_fp32: float parameters (FX: fp32 masters; ONNX: fp32 initializers).
        param_bytes_low: low-precision weights (FX: the copies the graph makes; ONNX:
            fp16/bf16 initializers).
        param_bytes_baseline: the parameters of the all-fp32 graph.
        activation_bytes: output bytes of every node that is not a view, casts included.
        activation_bytes_fp32: the same of the graph before the rewrite.
        peak_bytes: peak live activation bytes of an in-order run, each value freed after
            its last use.
        peak_bytes_fp32: the same of the graph before the rewrite.
        fp8_flops: the part of ``flops`` in FP8 products (not in ``low_flops``).
        param_bytes_fp8: the FP8 weight copies the FP8 products make (one byte a value).

    Example:
        >>> costs = graph_costs([gm])
        >>> costs.low_flops / costs.flops
        1.0
    """

    flops: int
    low_flops: int
    param_bytes_fp32: int
    param_bytes_low: int
    param_bytes_baseline: int
    activation_bytes: int
    activation_bytes_fp32: int
    peak_bytes: int
    peak_bytes_fp32: int
    fp8_flops: int = 0
    param_bytes_fp8: int = 0


__all__ = ["GraphCosts"]
