"""The whole train step as CUDA graphs: how ``build_train_step(cuda_graph=True)`` captures
and replays its phases on a GPU (``ampgraph.train.graphs.StepGraphs`` drives it).

``torch.cuda.graph`` on a side stream, warm-up on that stream too (what
``torch.cuda.make_graphed_callables`` and torch's whole-network example do), a private
memory pool per graph: graphs of several input shapes are replayed in any order, so none
may reuse another's memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["CudaGraphEngine", "captures_on"]


def captures_on(device: torch.device) -> bool:
    """Whether a step on ``device`` can be captured as a CUDA graph.

    Example:
        >>> captures_on(torch.device("cpu"))
        False
    """
    return device.type == "cuda" and torch.cuda.is_available()


class CudaGraphEngine:
    """Capture with ``torch.cuda.graph`` and replay with ``CUDAGraph.replay``.

    Example:
        >>> engine = CudaGraphEngine()  # doctest: +SKIP
        >>> graph, out = engine.capture(step, args, kwargs, prepare=lambda: None)  # +SKIP
    """

    def __init__(self) -> None:
        self._stream: Any = None

    def _side(self) -> Any:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def warmup(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """One ordinary call on the side stream the capture will use (lazy state, cuBLAS
        workspaces and autograd's streams are set up outside the capture)."""
        stream = self._side()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            out = fn(*args, **kwargs)
        torch.cuda.current_stream().wait_stream(stream)
        return out

    def capture(self, fn: Callable[..., Any], args: tuple, kwargs: dict,
                prepare: Callable[[], None]) -> tuple[Any, Any]:
        """Record ``fn(*args, **kwargs)`` after ``prepare()``, then replay it once: the
        capture only records, and the call that asked must still train."""
        graph = torch.cuda.CUDAGraph()
        prepare()
        with torch.cuda.graph(graph, stream=self._side()):
            out = fn(*args, **kwargs)
        graph.replay()
        return graph, out

    def replay(self, handle: Any, out: Any) -> Any:
        handle.replay()
        return out
