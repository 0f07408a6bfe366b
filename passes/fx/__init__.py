"""The torch.fx dialect: dataflow graph, cast insertion, folding, fusions, routing, verification.

One module per concept: ``graph`` (FX -> dataflow graph, prepare), ``dtypes`` (dtype
metadata), ``rules`` (what each input needs), ``cast_factory`` (shared hoisted casts),
``propagate`` (dtype propagation), ``insert_casts``, ``fold``, ``fusions``
(value-preserving rewrites), ``capabilities`` (device probes), ``routing`` (ops handed to
the runtime), ``hazards`` (range analysis), ``verify`` and ``pipeline``;
``_torch_internals`` holds every private torch API they use.
"""

from __future__ import annotations

from passes.fx.dtypes import dtype_of, is_amp_cast
from passes.fx.fold import (
    count_casts,
    drop_dead_ops,
    fold_casts,
    merge_duplicate_ops,
    skip_whole_slices,
)
from passes.fx.graph import build_dataflow, op_key, prepare
from passes.fx.insert_casts import annotate, insert_casts
from passes.fx.pipeline import FxAmpResult, amp_passes, run_amp_passes
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
