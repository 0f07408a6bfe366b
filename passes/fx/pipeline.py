"""The FX AMP pipeline: prepare, dataflow, paint, annotate, casts, fold, fuse, verify, route."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import networkx as nx
import torch
from torch import fx

from passes._infra import PassManager, PassResult, named
from passes.fx.autocast_regions import force_autocast_off
from passes.fx.calibration import force_calibrated, tag_calibrated
from passes.fx.checkpoints import outline_checkpoints
from passes.fx.dataflow import build_dataflow
from passes.fx.fold.cast_count import count_casts
from passes.fx.fold.casts import fold_casts
from passes.fx.fold.constant_casts import fold_constant_casts
from passes.fx.fold.dead_ops import drop_dead_ops
from passes.fx.fold.duplicate_ops import merge_duplicate_ops
from passes.fx.fold.identities import skip_identity_ops
from passes.fx.fold.mask_conversions import share_mask_conversions
from passes.fx.fold.true_masks import drop_true_masks
from passes.fx.fold.whole_slices import skip_whole_slices
from passes.fx.fp8_recipe import FP8Recipe
from passes.fx.fusions import channels_last, gather_casts, norm_casts
from passes.fx.fusions.kv_heads import group_kv_heads, stack_kv_queries
from passes.fx.fusions.tanh_gelu import fuse_tanh_gelu
from passes.fx.hazards import mark_range_hazards
from passes.fx.index_values import mark_index_values
from passes.fx.insert_casts import annotate, insert_casts
from passes.fx.layouts import contiguous_linear_inputs
from passes.fx.periodic import mark_periodic_arguments
from passes.fx.prepare import prepare
from passes.fx.routing.attention import route_attention
from passes.fx.routing.dropouts import route_dropouts
from passes.fx.routing.embeddings import route_embeddings
from passes.fx.routing.fp8_products import route_fp8_products
from passes.fx.routing.head_loss import route_head_loss
from passes.fx.routing.linears import route_linears
from passes.fx.routing.output_casts import route_output_casts
from passes.fx.routing.weight_casts import route_weight_casts
from passes.fx.runtime_ops import ATEN_ONLY, RuntimeOps
from passes.fx.verify import verify
from passes.fx.weight_groups import group_weight_casts
from passes.fx.written_views import mark_written_views
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
    fuse_norm_casts: bool = True,
    channels_last_inputs: bool = True,
    sink_gather_casts: bool = True,
    runtime: RuntimeOps = ATEN_ONLY,
    fp8: FP8Recipe | None = None,
    head_loss: str = "auto",
) -> FxAmpResult:
    """Rewrite ``gm`` in place for mixed precision and verify the result.

    Args:
        gm: an aten-level graph from ``torch.export`` (nodes carry fake-tensor ``val``).
        policy: from ``passes.policy.make_policy``.
        low: torch.bfloat16 or torch.float16.
        keep_io_types: cast float outputs back to their original dtype.
        fuse_norm_casts: let fp32 norms take and return ``low`` activations where every
            use wanted ``low`` (``passes.fx.fusions.norm_casts``).
        channels_last_inputs: cast 4-D inputs of convolutions, then the convolutions'
            weights, to channels-last (``passes.fx.fusions.channels_last``).
        sink_gather_casts: cast embedding lookups instead of their tables
            (``passes.fx.fusions.gather_casts``).
            These three fusions keep every value and copy fewer bytes; each switch runs
            the pass of its name.
        runtime: what the device's runtime carries out its own way (``RuntimeOps``: the
            routed ops, and whether attention takes unrepeated grouped key/value heads);
            by default every op stays aten's.
        fp8: the recipe of the products that run in FP8 (``routing.route_fp8_products``,
            with ``runtime.fp8_linear``); None: none do.
        head_loss: "auto", "drop_logits" or "off": the last product and its cross-entropy
            as the runtime's one chunked op (``routing.route_head_loss``, with
            ``runtime.head_loss``), where nothing else reads the logits ("auto"), or
            also where the graph returns them, returning None in their place
            ("drop_logits").

    The passes (:func:`amp_passes`) run through ``passes._infra.PassManager``: any failure
    raises ``PassError`` naming the pass and, when known, the node it was processing. The
    cyclic garbage collector is off while they run (:func:`gc_paused`).

    Example:
        >>> run_amp_passes(ep.module(), make_policy("O2"), torch.bfloat16).casts
        7
    """
    state = PipelineState()
    with gc_paused():
        PassManager(amp_passes(
            policy, low, state, keep_io_types=keep_io_types, fuse_norm_casts=fuse_norm_casts,
            channels_last_inputs=channels_last_inputs, sink_gather_casts=sink_gather_casts,
            runtime=runtime, fp8=fp8, head_loss=head_loss)).run(gm)
    return FxAmpResult(gm, state.decisions, state.casts)


@dataclass
class PipelineState:
    """What the pipeline's analyses hand to later passes and to :class:`FxAmpResult`."""

    dataflow: nx.DiGraph | None = None
    decisions: dict[str, Decision] = field(default_factory=dict)
    casts: int = 0


def amp_passes(
    policy: LevelPolicy,
    low: torch.dtype,
    state: PipelineState,
    *,
    keep_io_types: bool = True,
    fuse_norm_casts: bool = True,
    channels_last_inputs: bool = True,
    sink_gather_casts: bool = True,
    runtime: RuntimeOps = ATEN_ONLY,
    fp8: FP8Recipe | None = None,
    head_loss: str = "auto",
) -> list[Callable[[fx.GraphModule], PassResult]]:
    """The passes :func:`run_amp_passes` runs, in order, each a named ``fn(gm) ->
    PassResult`` (the name a failure is reported under). The analyses write into
    ``state``. Arguments as for :func:`run_amp_passes`.

    Example:
        >>> [p.__name__ for p in amp_passes(make_policy("O2"), torch.bfloat16, PipelineState())][:3]
        ['prepare', 'skip_whole_slices', 'merge_duplicate_ops']
    """
    calibrated = low == torch.float16 and policy.level != "O0" and policy.calibrated
    passes = [named("tag_calibrated", _tag_calibrated, dict(policy.calibrated))] \
        if calibrated else []  # on the graph as captured: the keys were made on it
    passes += [
        named("prepare", prepare, recompile=False),
        named("skip_whole_slices", skip_whole_slices, recompile=False),
        named("merge_duplicate_ops", merge_duplicate_ops, by_module=bool(policy.overrides.modules),
              recompile=False),
    ]
    if policy.level != "O0":  # O0 runs the graph's own ops
        passes.append(named("fuse_tanh_gelu", fuse_tanh_gelu))
        passes.append(named("skip_identity_ops", skip_identity_ops, recompile=False))
        passes.append(named("drop_true_masks", drop_true_masks, recompile=False))
    passes += [
        # ops nothing uses: they must not sway the painter (a dead top-k would keep its
        # inputs fp32 here, and a second run, without it, paint them low)
        named("drop_unused_ops", drop_dead_ops, recompile=False),
        named("build_dataflow", _build_dataflow, state),
    ]
    if low in (torch.float16, torch.bfloat16) and policy.level != "O0":
        passes.append(named("mark_range_hazards", _mark_range_hazards, state, low))
        passes.append(named("mark_written_views", _mark_written_views, state))
        passes.append(named("force_autocast_off", _force_autocast_off, state))
        if calibrated:
            passes.append(named("force_calibrated", _force_calibrated, state))
        if policy.level != "O3":
            passes.append(named("mark_index_values", _mark_index_values, state, policy))
            passes.append(named("mark_periodic_arguments", _mark_periodic_arguments, state,
                                policy))
    passes += [
        named("paint", _paint, state, policy),
        named("annotate", _annotate, state),
        named("insert_casts", insert_casts, low, keep_io_types=keep_io_types, recompile=False),
        named("fold_casts", fold_casts, recompile=False),
        named("fold_constant_casts", fold_constant_casts, recompile=False),
    ]
    # each switch runs the pass of its name (the module is named: the switch shadows it)
    if fuse_norm_casts:
        passes.append(named("fuse_norm_casts", norm_casts.fuse_norm_casts, low))
    if channels_last_inputs:
        passes.append(named("channels_last_inputs", channels_last.channels_last_inputs, low))
    if sink_gather_casts:
        passes.append(named("sink_gather_casts", gather_casts.sink_gather_casts, low))
    if runtime.unrepeated_kv_heads:
        passes.append(named("group_kv_heads", group_kv_heads))
    if runtime.attention is None and policy.level != "O0":  # aten's attention: see the pass
        passes.append(named("share_mask_conversions", share_mask_conversions, recompile=False))
    if runtime.stacked_kv_heads:  # after the masks' conversion: converted rows repeated once
        passes.append(named("stack_kv_queries", stack_kv_queries, recompile=False))
    passes += [
        named("drop_dead_ops", drop_dead_ops, recompile=False),
        named("contiguous_linear_inputs", contiguous_linear_inputs, low),
        named("verify", verify, low),
        named("count_casts", _count_casts, state),
    ]
    rt = runtime
    if rt.head_loss is not None and policy.level != "O0" and low != torch.float32:
        passes.append(named("route_head_loss", route_head_loss, rt.head_loss, low,
                            rt.head_loss_chunk, head_loss))
    if fp8 is not None and policy.level != "O0" and low in (torch.float16, torch.bfloat16):
        if rt.fp8_linear is None:
            raise ValueError("fp8: this runtime has no FP8 product (RuntimeOps.fp8_linear)")
        passes.append(named("route_fp8_products", route_fp8_products, rt.fp8_linear, low, fp8,
                            policy.overrides.prefix))
    if rt.weight_group is not None:
        passes.append(named("group_weight_casts", group_weight_casts, rt.weight_group,
                            rt.group_numel, recompile=False))
    if rt.weight_cast is not None:
        passes.append(named("route_weight_casts", route_weight_casts, rt.weight_cast,
                            recompile=False))
        if rt.linear is not None:
            passes.append(named("route_linears", route_linears, rt.linear, low,
                                rt.linear_activations))
        if rt.embedding is not None:
            passes.append(named("route_embeddings", route_embeddings, rt.embedding))
    if rt.attention is not None:
        passes.append(named("route_attention", route_attention, rt.attention, low))
    if rt.dropout is not None:
        passes.append(named("route_dropouts", route_dropouts, rt.dropout, low))
    if rt.output_cast is not None and keep_io_types:
        passes.append(named("route_output_casts", route_output_casts, rt.output_cast))
    # last: a region is recomputed with the casts and runtime ops its forward runs
    passes.append(named("outline_checkpoints", outline_checkpoints))
    passes.append(named("recompile", _recompile))
    return passes


# The analyses, as passes: each leaves the graph as it is and hands its result on in state.


def _build_dataflow(gm: fx.GraphModule, state: PipelineState) -> PassResult:
    state.dataflow = build_dataflow(gm)
    return PassResult(gm, False)


def _mark_range_hazards(gm: fx.GraphModule, state: PipelineState, low: torch.dtype) -> PassResult:
    mark_range_hazards(state.dataflow, gm, low)
    return PassResult(gm, False)


def _mark_written_views(gm: fx.GraphModule, state: PipelineState) -> PassResult:
    mark_written_views(state.dataflow, gm)
    return PassResult(gm, False)


def _force_autocast_off(gm: fx.GraphModule, state: PipelineState) -> PassResult:
    force_autocast_off(state.dataflow, gm)
    return PassResult(gm, False)


def _tag_calibrated(gm: fx.GraphModule, calibrated: dict) -> PassResult:
    tag_calibrated(gm, calibrated)  # node.meta only
    return PassResult(gm, False)


def _force_calibrated(gm: fx.GraphModule, state: PipelineState) -> PassResult:
    force_calibrated(state.dataflow, gm)
    return PassResult(gm, False)


def _mark_index_values(gm: fx.GraphModule, state: PipelineState,
                       policy: LevelPolicy) -> PassResult:
    mark_index_values(state.dataflow, gm, policy)
    return PassResult(gm, False)


def _mark_periodic_arguments(gm: fx.GraphModule, state: PipelineState,
                             policy: LevelPolicy) -> PassResult:
    mark_periodic_arguments(state.dataflow, policy)
    return PassResult(gm, False)


def _paint(gm: fx.GraphModule, state: PipelineState, policy: LevelPolicy) -> PassResult:
    state.decisions = paint(state.dataflow, policy)
    return PassResult(gm, False)


def _annotate(gm: fx.GraphModule, state: PipelineState) -> PassResult:
    annotate(gm, state.decisions)  # node.meta only
    return PassResult(gm, False)


def _count_casts(gm: fx.GraphModule, state: PipelineState) -> PassResult:
    state.casts = count_casts(gm)
    return PassResult(gm, False)


def _recompile(gm: fx.GraphModule) -> PassResult:
    """Regenerate ``gm.forward`` once, for every pass before (they leave it to the end)."""
    gm.recompile()
    return PassResult(gm, False)
