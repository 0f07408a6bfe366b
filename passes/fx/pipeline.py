"""The FX AMP pipeline: prepare, dataflow, paint, annotate, casts, fold, verify."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from passes.fx.fold import count_casts, fold_casts
from passes.fx.fusions import channels_last_inputs, fuse_norm_casts, sink_gather_casts
from passes.fx.graph import build_dataflow, prepare
from passes.fx.hazards import mark_range_hazards
from passes.fx.insert_casts import annotate, insert_casts
from passes.fx.routing import (
    route_attention,
    route_embeddings,
    route_linears,
    route_weight_casts,
)
from passes.fx.verify import verify
from passes.paint import Decision, paint
from passes.policy import LevelPolicy


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body with the cyclic garbage collector off, then restore its previous state.

    The passes allocate many small containers and free almost none of them, so the
    collector cannot reclaim anything meanwhile, but with it on a large graph pays a full
    collection of the whole heap partway through (the captured graph's fake tensors: ~1 s
    at 50k nodes). Paused, that collection is deferred, not avoided: the next one after the
    passes scans their objects too. The switch is process-wide (other threads' cyclic
    garbage waits as well); a collector already off stays off.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class FxAmpResult:
    """The rewritten module and what the passes decided."""

    gm: fx.GraphModule
    decisions: dict[str, Decision]
    casts: int


def run_amp_passes(
    gm: fx.GraphModule,
    policy: LevelPolicy,
    low: torch.dtype,
    *,
    keep_io_types: bool = True,
    weight_cast: Callable[..., Any] | None = None,
    fuse_norms: bool = True,
    linear: Callable[..., Any] | None = None,
    embedding: Callable[..., Any] | None = None,
    attention: Callable[..., Any] | None = None,
) -> FxAmpResult:
    """Rewrite ``gm`` in place for mixed precision and verify the result.

    Args:
        gm: an aten-level graph from ``torch.export`` (nodes carry fake-tensor ``val``).
        policy: from ``passes.policy.make_policy``.
        low: torch.bfloat16 or torch.float16.
        keep_io_types: cast float outputs back to their original dtype.
        weight_cast: if given, parameter casts call ``weight_cast(param, dtype)`` (a cache of
            low-precision working copies) instead of ``aten._to_copy``.
        linear: with ``weight_cast``, low-precision ``aten.linear`` nodes on a cast parameter
            call ``linear(x, w, b)`` instead (the runtime's choice of where weight
            gradients go).
        embedding: with ``weight_cast``, ``aten.embedding`` nodes on a float parameter call
            ``embedding(table, ids, padding_idx)`` instead (likewise).
        attention: if given, low-precision ``aten.scaled_dot_product_attention`` nodes call
            it with the same arguments instead (the runtime's choice of kernel).
        fuse_norms: let fp32 norms take and return ``low`` activations where every use
            wanted ``low``, cast 4-D inputs of convolutions to channels-last and cast
            embedding lookups instead of their tables (``passes.fx.fusions``): same numbers,
            fewer bytes copied.

    The cyclic garbage collector is off while the passes run (:func:`gc_paused`).

    Example:
        >>> run_amp_passes(ep.module(), make_policy("O2"), torch.bfloat16).casts
        7
    """
    with gc_paused():
        prepare(gm, recompile=False)
        graph = build_dataflow(gm)
        if low in (torch.float16, torch.bfloat16) and policy.level != "O0":
            mark_range_hazards(graph, gm, low)
        decisions = paint(graph, policy)
        annotate(gm, decisions)
        insert_casts(gm, low, keep_io_types=keep_io_types, recompile=False)
        fold_casts(gm, recompile=False)
        if fuse_norms:
            fuse_norm_casts(gm, low)
            channels_last_inputs(gm, low)
            sink_gather_casts(gm, low)
        verify(gm, low)
        casts = count_casts(gm)
        if weight_cast is not None:
            route_weight_casts(gm, weight_cast, recompile=False)
            if linear is not None:
                route_linears(gm, linear, low)
            if embedding is not None:
                route_embeddings(gm, embedding)
        if attention is not None:
            route_attention(gm, attention, low)
        gm.recompile()
        return FxAmpResult(gm, decisions, casts)
