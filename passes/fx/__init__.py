"""The torch.fx dialect: dataflow graph, cast insertion, folding, fusions, routing, verification.

One module per concept, one pass per module: ``prepare`` (the first pass), ``nodes`` (what
the passes read off a node), ``dataflow`` (FX -> the painter's dataflow graph), ``dtypes``
(dtype metadata), ``rules`` (what each input needs), ``cast_factory`` (shared hoisted casts),
``propagate`` (dtype propagation), ``insert_casts``, the ``fold`` family (cast folding and
value-keeping clean-ups), the ``fusions`` family (value-preserving rewrites),
``capabilities`` (device probes), ``layouts``, ``hazards`` and ``index_values`` (range
analyses), ``runtime_ops`` (what the runtime does its own way), ``weight_groups`` and the
``routing`` family (ops handed to the runtime), ``grad_scale``, ``no_grad_regions``,
``checkpoints`` (checkpointed regions outlined), ``verify`` and ``pipeline``;
``_torch_internals`` holds every private torch API they use.
"""

from __future__ import annotations

from passes.fx.dataflow import build_dataflow
from passes.fx.dtypes import dtype_of, is_amp_cast
from passes.fx.fold.cast_count import count_casts
from passes.fx.fold.casts import fold_casts
from passes.fx.fold.dead_ops import drop_dead_ops
from passes.fx.fold.duplicate_ops import merge_duplicate_ops
from passes.fx.fold.whole_slices import skip_whole_slices
from passes.fx.insert_casts import annotate, insert_casts
from passes.fx.nodes import op_key
from passes.fx.pipeline import FxAmpResult, amp_passes, run_amp_passes
from passes.fx.prepare import prepare
from passes.fx.verify import verify

__all__ = [
    "FxAmpResult",
    "amp_passes",
    "annotate",
    "build_dataflow",
    "count_casts",
    "drop_dead_ops",
    "dtype_of",
    "fold_casts",
    "insert_casts",
    "is_amp_cast",
    "merge_duplicate_ops",
    "op_key",
    "prepare",
    "run_amp_passes",
    "skip_whole_slices",
    "verify",
]
