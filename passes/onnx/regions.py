"""Painted regions: connected components of low-precision nodes.

The automatic mode of ``ampgraph.convert_onnx`` bisects over these instead of single
nodes: keeping a whole region in FP32 removes its casts with it, and there are far fewer
regions than nodes (a transformer block at O2 is a handful).
"""

from __future__ import annotations

from collections.abc import Callable

import networkx as nx

from passes.paint import Assignment
from passes.policy import LOW


def low_regions(graph: nx.DiGraph, assignment: Assignment) -> list[list[str]]:
    """Connected components of low-precision compute nodes, in topological order.

    Args:
        graph: the dataflow graph from ``passes.onnx.graph.build_dataflow``.
        assignment: its painting.

    Returns:
        One list of node names per region, each sorted topologically; regions sorted by
        their first node.

    Example:
        >>> low_regions(graph, assignment)
        [['conv_0', 'relu_1'], ['gemm_5']]
    """
    low = [
        v for v, d in assignment.items()
        if d.precision == LOW and graph.nodes[v].get("kind") == "compute"
    ]
    order = {v: i for i, v in enumerate(nx.topological_sort(graph))}
    undirected = graph.subgraph(low).to_undirected(as_view=True)
    regions = [sorted(c, key=order.__getitem__) for c in nx.connected_components(undirected)]
    return sorted(regions, key=lambda r: order[r[0]])


def bisect_regions(
    count: int, error_of: Callable[[frozenset[int]], float], tolerance: float
) -> frozenset[int]:
    """The regions to keep in FP32 so that ``error_of(kept) <= tolerance``, few of them.

    Adaptive group testing: while the kept set fails, binary-search the shortest prefix of
    the remaining regions (in topological order) whose addition passes; its last region is
    needed, keep it. Each needed region costs about log2(count) trials, assuming more FP32
    never makes the error worse.

    Args:
        count: number of regions (see :func:`low_regions`).
        error_of: error of the model with the given region indices kept in FP32.
        tolerance: the largest acceptable error.

    Raises:
        ValueError: even with every region in FP32 the error exceeds ``tolerance``.

    Example:
        >>> bisect_regions(8, lambda kept: 0.0 if 5 in kept else 1.0, 0.1)
        frozenset({5})
    """
    kept: frozenset[int] = frozenset()
    if error_of(kept) <= tolerance:
        return kept
    every = frozenset(range(count))
    if error_of(every) > tolerance:
        raise ValueError(f"tolerance {tolerance:g} cannot be met: with every painted region "
                         f"in fp32 the error is still {error_of(every):.3g}")
    candidates = list(range(count))
    while error_of(kept) > tolerance:
        lo, hi = 1, len(candidates)
        while lo < hi:
            mid = (lo + hi) // 2
            if error_of(kept | frozenset(candidates[:mid])) <= tolerance:
                hi = mid
            else:
                lo = mid + 1
        kept = kept | {candidates[lo - 1]}
        del candidates[lo - 1]
    return kept


__all__ = ["bisect_regions", "low_regions"]
