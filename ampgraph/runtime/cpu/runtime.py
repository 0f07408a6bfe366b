"""CpuRuntime: the CPU's ops, where fresh memory faults its pages in and oneDNN runs bf16.

- parameter casts and linears (transformers' ``Conv1D`` products too, and the activation
  reading a linear's output) through :class:`~ampgraph.runtime.cpu.weights.WeightCache`
  (kept working copies and gradient buffers, blocked products of large weights, packed
  inference weights);
- embeddings whose large tables' gradients go into kept buffers;
- attention unfused where that is faster (``attention.py``), dropout's faster draw
  (``dropout.py``), large outputs cast back into kept buffers (``outputs.py``);
- attention on unrepeated grouped key/value heads;
- the head's product and its cross-entropy in chunks (``runtime/head_loss.py``);
- around a graph handed to ``torch.compile``, for calls without gradients: the weights'
  kept inference copies as its inputs, its outputs cast back into kept buffers, and a
  linear whose product is an output (the logits) made into one block by block.

The measured trade-off behind each: docs/performance.md#runtime-choices.
"""

from __future__ import annotations

import torch

from ampgraph.runtime.base import CompiledEdges, Runtime
from ampgraph.runtime.cpu.activations import ACTIVATIONS
from ampgraph.runtime.cpu.attention import amp_attention
from ampgraph.runtime.cpu.dropout import amp_dropout
from ampgraph.runtime.cpu.outputs import OutputBuffers
from ampgraph.runtime.cpu.weights import WeightCache
from ampgraph.runtime.head_loss import chunk_rows, linear_cross_entropy
from passes.fx.runtime_ops import RuntimeOps


class CpuRuntime(Runtime):
    """The CPU runtime; see the module docstring.

    Example:
        >>> CpuRuntime().ops(backend=None).linear is not None
        True
    """

    name = "cpu"

    def __init__(self) -> None:
        self.weights = WeightCache()
        self.outputs = OutputBuffers()

    def ops(self, backend: str | None) -> RuntimeOps:
        if backend is not None:  # torch.compile traces the attention op (it has fake
            # kernels); the cache's Python and the dropout draw stay out of its graphs
            return RuntimeOps(attention=amp_attention, unrepeated_kv_heads=True,
                              fp8_linear=self.fp8_linear(backend))
        return RuntimeOps(
            weight_cast=self.weights.cast, linear=self.weights.amp_linear,
            linear_activations=frozenset(ACTIVATIONS),
            embedding=self.weights.amp_embedding, attention=amp_attention,
            dropout=amp_dropout, output_cast=self.outputs.cast, unrepeated_kv_heads=True,
            fp8_linear=self.fp8_linear(backend), head_loss=linear_cross_entropy,
            head_loss_chunk=chunk_rows)

    def compiled_edges(self) -> CompiledEdges:
        return CompiledEdges(weight_copy=self.weights.cast, output_cast=self.outputs.cast,
                             output_linear=self.outputs.linear)

    def working_copies(self) -> list[torch.Tensor]:
        return self.weights.train_copies()

    def nbytes(self) -> int:
        return self.weights.nbytes() + self.outputs.nbytes()

    def clear(self) -> None:
        self.weights.clear()
        self.outputs.clear()
        self.clear_fp8()
