"""Fusions: rewrites that keep every value and copy fewer bytes (after cast insertion), or
run a function written out in elementwise ops as its one kernel (before painting), one pass
per module.

- ``norm_casts``: :func:`fuse_norm_casts`, the casts around fp32 normalisation go into the
  norm kernel (where a probe on the device allows: ``passes.fx.capabilities``).
- ``channels_last``: :func:`channels_last_inputs`, inputs of convolutions are cast straight
  to channels-last.
- ``gather_casts``: :func:`sink_gather_casts`, an embedding gathers from its fp32 table and
  casts the rows.
- ``tanh_gelu``: :func:`fuse_tanh_gelu`, the tanh-GELU written out in elementwise ops
  (GPT-2's ``gelu_new``) becomes ``aten.gelu(approximate="tanh")``, before painting.
- ``kv_heads``: :func:`group_kv_heads` and :func:`stack_kv_queries`, attention on
  key/value heads repeated for grouped-query attention takes the unrepeated ones
  (``enable_gqa``, or the query heads of each stacked as its rows), for a runtime that asks
  for it.

(Rewrites that hand ops to the runtime are ``passes.fx.routing``.) The modules import one
another only by their own paths, never this ``__init__``.
"""

from __future__ import annotations

from passes.fx.fusions.channels_last import channels_last_inputs
from passes.fx.fusions.gather_casts import sink_gather_casts
from passes.fx.fusions.kv_heads import group_kv_heads, stack_kv_queries
from passes.fx.fusions.norm_casts import fuse_norm_casts
from passes.fx.fusions.tanh_gelu import fuse_tanh_gelu

__all__ = ["channels_last_inputs", "fuse_norm_casts", "fuse_tanh_gelu", "group_kv_heads",
           "sink_gather_casts", "stack_kv_queries"]
