"""RuntimeOps: what a device's runtime carries out its own way, as the passes see it.

The passes never ask which device they rewrite for. The caller (``ampgraph``'s runtime
for the model's device) hands :func:`passes.fx.run_amp_passes` one ``RuntimeOps``; each
field left ``None`` (or ``False``) keeps the graph's own aten op. A runtime fills only
what it does differently:

- ``weight_cast(param, dtype, memory_format=None)``: a parameter's cast, placed at its
  first use (``routing.route_weight_casts``);
- ``weight_group(specs)``: a factory; the callable it returns takes a group of parameters
  and returns their low-precision copies, so a group is refreshed and its gradients
  returned by multi-tensor ops (``weight_groups.group_weight_casts``; exclusive with
  ``weight_cast``);
- ``linear``, ``embedding`` (with ``weight_cast``), ``attention``, ``dropout``,
  ``output_cast``: the ops ``routing`` hands over (``linear(x, w, b, shared=False,
  activation=None, transposed=False)`` also takes ``addmm(b, x, w)`` on a weight stored
  ``[in, out]``, as ``transposed=True``);
- ``linear_activations``: the activations (``passes.fx.routing.linears.ACTIVATIONS``'
  names) that ``linear`` applies itself when one is its output's only reader;
- ``unrepeated_kv_heads``: attention takes grouped key/value heads unrepeated
  (``fusions.group_kv_heads``: ``enable_gqa``), where the device's kernels run that faster;
- ``stacked_kv_heads``: attention takes grouped key/value heads unrepeated, the query heads
  of each stacked as its rows (``fusions.stack_kv_queries``: equal head counts, for kernels
  that take ``enable_gqa`` with a mask on a slow path only); exclusive with
  ``unrepeated_kv_heads``;
- ``fp8_linear(x, w, b, transposed=, scaling=, weight_grad=)``: the FP8 product of the
  products an FP8 recipe chooses (``routing.route_fp8_products``), from the fp32 master;
- ``head_loss(x, w, b, target, reduction=, ignore_index=, label_smoothing=, chunk=)`` and
  ``head_loss_chunk(rows, vocab)``: the last product and its cross-entropy in chunks of
  rows (``routing.route_head_loss``), and the chunk it picks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RuntimeOps:
    """The runtime's ops handed to the FX pipeline; see the module docstring.

    Example:
        >>> RuntimeOps(dropout=my_dropout).routes_weights
        False
    """

    weight_cast: Callable[..., Any] | None = None
    weight_group: Callable[..., Any] | None = None
    group_numel: int = 1 << 24
    linear: Callable[..., Any] | None = None
    linear_activations: frozenset[str] = frozenset()
    embedding: Callable[..., Any] | None = None
    attention: Callable[..., Any] | None = None
    dropout: Callable[..., Any] | None = None
    output_cast: Callable[..., Any] | None = None
    unrepeated_kv_heads: bool = False
    stacked_kv_heads: bool = False
    fp8_linear: Callable[..., Any] | None = None
    head_loss: Callable[..., Any] | None = None
    head_loss_chunk: Callable[[int, int], int] | None = None

    def __post_init__(self) -> None:
        if self.weight_cast is not None and self.weight_group is not None:
            raise ValueError("RuntimeOps: weight_cast and weight_group are exclusive: a "
                             "parameter's cast is routed one way")
        if self.unrepeated_kv_heads and self.stacked_kv_heads:
            raise ValueError("RuntimeOps: unrepeated_kv_heads and stacked_kv_heads are "
                             "exclusive: attention takes the unrepeated heads one way")
        if (self.head_loss is None) != (self.head_loss_chunk is None):
            raise ValueError("RuntimeOps: head_loss and head_loss_chunk come together")
        if (self.linear or self.embedding) and self.weight_cast is None:
            raise ValueError("RuntimeOps: linear and embedding take the weight_cast's "
                             "parameters: give weight_cast too")

    @property
    def routes_weights(self) -> bool:
        """Whether parameter casts are handed to the runtime at all."""
        return self.weight_cast is not None or self.weight_group is not None


ATEN_ONLY = RuntimeOps()  # every op the graph's own
