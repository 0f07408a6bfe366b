"""Cast folding and the clean-ups that keep every value, one pass per module.

- ``casts``: :func:`fold_casts`, cast chains folded where values allow;
- ``constant_casts``: :func:`fold_constant_casts`, casts of the graph's constants made once;
- ``identities``: :func:`skip_identity_ops`, ``x * 1``, integer ``x + 0``, ``True & x``
  skipped;
- ``mask_conversions``: :func:`share_mask_conversions`, a boolean attention mask made
  additive once per graph;
- ``true_masks``: :func:`drop_true_masks`, an attention mask True everywhere dropped;
- ``whole_slices``: :func:`skip_whole_slices`, slices of a whole dimension skipped;
- ``duplicate_ops``: :func:`merge_duplicate_ops`, pure ops computed once per arguments;
- ``dead_ops``: :func:`drop_dead_ops`, ops the rewrite left unused removed;
- ``cast_count``: :func:`count_casts`, the casts the passes inserted.

The modules import one another only by their own paths, never this ``__init__``.
"""

from __future__ import annotations

from passes.fx.fold.cast_count import count_casts
from passes.fx.fold.casts import fold_casts
from passes.fx.fold.constant_casts import fold_constant_casts
from passes.fx.fold.dead_ops import drop_dead_ops
from passes.fx.fold.duplicate_ops import merge_duplicate_ops
from passes.fx.fold.identities import skip_identity_ops
from passes.fx.fold.mask_conversions import share_mask_conversions
from passes.fx.fold.true_masks import drop_true_masks
from passes.fx.fold.whole_slices import skip_whole_slices

__all__ = ["count_casts", "drop_dead_ops", "drop_true_masks", "fold_casts", "fold_constant_casts",
           "merge_duplicate_ops", "share_mask_conversions", "skip_identity_ops",
           "skip_whole_slices"]
