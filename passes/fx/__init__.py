"""The torch.fx dialect: dataflow graph, cast insertion, folding and verification."""

from __future__ import annotations

from passes.fx.fold import fold_casts
from passes.fx.graph import build_dataflow, op_key, prepare
from passes.fx.insert_casts import insert_casts
from passes.fx.pipeline import FxAmpResult, run_amp_passes
from passes.fx.verify import verify

__all__ = [
    "FxAmpResult",
    "build_dataflow",
    "fold_casts",
    "insert_casts",
    "op_key",
    "prepare",
    "run_amp_passes",
    "verify",
]
