"""A loss scale that grows on measured underflow and backs off with hysteresis.

``AdaptiveLossScaleManager`` keeps the interface of the other managers (``scale``,
``update_loss_scale``, ``state_dict`` ...) and uses the optional hooks of
``LossScaleManager``: :meth:`observe_gradients` measures the unscaled gradients of clean
steps, :meth:`unscale_` divides per layer when ``per_layer=True``, and :meth:`instrument`
inserts the per-layer gradient-scale ops into the compiled graph
(``passes/fx/grad_scale.py`` + ``ampgraph/runtime/grad_scale.py``).

The measure (docs/training.md, "Adaptive loss scaling"): with fp32 master weights each
weight gradient the fp16 backward produced reaches ``p.grad`` converted to fp32 and is
divided by a power of two, so ``|g| * scale`` is exactly the value the backward held. An
element is *underflowed* when it is non-zero and ``|g| * scale < 2**-14`` (fp16's smallest
normal: it is subnormal and has lost precision). Exact zeros are left out of both counts:
without an fp32 reference a value flushed to zero cannot be told from a structural zero
(a dead ReLU, a zero input pixel). The underflow fraction is underflowed / non-zero elements,
per region (the whole model, or each layer when ``per_layer``).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from ampgraph.runtime.grad_scale import GradScaleEdge
from ampgraph.train.loss_scale.base import LossScaleManager, overflow_flag
from ampgraph.train.loss_scale.values import real, scale_value
from passes.fx.grad_scale import insert_grad_scales

__all__ = ["AdaptiveLossScaleManager"]

FP16_MAX = 65504.0
FP16_TINY = 2.0**-14  # fp16's smallest normal
_STATE_KEYS = ("loss_scale", "min_loss_scale", "max_loss_scale", "hysteresis",
               "hysteresis_left", "underflow_threshold", "per_layer", "layers", "layer_scales")


class AdaptiveLossScaleManager(LossScaleManager):
    """Loss scaling driven by gradient statistics instead of a fixed growth interval.

    - Overflow (inf/NaN loss or gradient): the step is skipped; the scale is halved only on
      the ``hysteresis``-th consecutive overflowing step and on each consecutive one after
      it (DeepSpeed's ``consecutive_hysteresis``: a clean step refills the tolerance), never
      below ``min_loss_scale``.
    - Clean step whose underflow fraction is above ``underflow_threshold``: the scale grows
      at once to the largest power-of-two multiple ``2**k`` (k >= 1) with
      ``amax * scale * 2**k <= 65504 / headroom`` (``amax`` the largest unscaled gradient
      magnitude), capped at ``max_loss_scale``. A region whose non-zero gradients all
      vanished grows by ``2**8``. No growth interval.
    - ``per_layer=True``: every module that owns parameters gets its own scale factor
      ``r`` inside the captured graph (Zhao et al. 2019): its weight gradients come out at
      ``scale * r`` and are unscaled per layer; the overflow check (all-reduced across ranks
      by the train step) and the hysteresis stay global.

    At most one host synchronisation per step (the step's own): statistics and updates are
    device tensors, and the statistics are computed only on steps that can grow (clean
    steps, when the step synchronises anyway).

    Args:
        init_loss_scale: the first scale (GradScaler's 2**16).
        min_loss_scale, max_loss_scale: bounds of the scale (of every layer's, per layer).
        hysteresis: consecutive overflowing steps before backing off, an integer >= 1.
        underflow_threshold: grow when more than this fraction of the non-zero gradient
            elements lies below fp16's smallest normal at the current scale, in [0, 1).
        per_layer: per-layer scales in the compiled graph (needs ``build_train_step``).

    Raises:
        ValueError: an argument outside those ranges.

    Example:
        >>> m = AdaptiveLossScaleManager(2.0**10, hysteresis=2)
        >>> m.update_loss_scale(True); m.get_loss_scale()      # tolerated
        1024.0
        >>> m.update_loss_scale(True); m.get_loss_scale()      # second in a row: backs off
        512.0
    """

    dynamic = True
    wants_gradients = True
    #: fp16 max / headroom bounds ``amax * new_scale`` when growing (room for activation
    #: gradients, which can exceed the weight gradients the statistics see).
    headroom: float = 2.0**8
    #: growth factor when a region's gradients are all zero (total underflow).
    blind_growth: float = 2.0**8

    def __init__(
        self, init_loss_scale: float = 2.0**16, *, min_loss_scale: float = 1.0,
        max_loss_scale: float = 2.0**24, hysteresis: int = 2, underflow_threshold: float = 0.01,
        per_layer: bool = False,
    ) -> None:
        owner = type(self).__name__
        init = scale_value(owner, "init_loss_scale", init_loss_scale)
        low = scale_value(owner, "min_loss_scale", min_loss_scale)
        high = scale_value(owner, "max_loss_scale", max_loss_scale)
        if not low <= init <= high:
            raise ValueError(f"{owner}: need min_loss_scale <= init_loss_scale <= "
                             f"max_loss_scale, got {low!r}, {init!r}, {high!r}")
        hyst = real(owner, "hysteresis", hysteresis, "an integer >= 1")
        if not hyst.is_integer() or not 1 <= hyst <= 2**30:
            raise ValueError(f"{owner}: hysteresis must be an integer >= 1, got {hysteresis!r}")
        thr = real(owner, "underflow_threshold", underflow_threshold, "a number in [0, 1)")
        if not 0.0 <= thr < 1.0:
            raise ValueError(f"{owner}: underflow_threshold must be in [0, 1), "
                             f"got {underflow_threshold!r}")
        if not isinstance(per_layer, bool):
            raise ValueError(f"{owner}: per_layer must be True or False, got {per_layer!r}")
        super().__init__(init)
        self.min_loss_scale, self.max_loss_scale = low, high
        self.hysteresis, self.underflow_threshold = int(hyst), thr
        self.per_layer = self.custom_unscale = per_layer
        self._left = torch.full((), self.hysteresis, dtype=torch.int32)
        self._layer_scales = torch.ones(1)  # index 0: the global region (always 1)
        self.layers: list[str] = []
        self._region_of: dict[int, int] = {}
        self._stats: torch.Tensor | None = None

    # -- per-layer plumbing ----------------------------------------------------------------

    @property
    def layer_scales(self) -> dict[str, float]:
        """Each layer's effective scale ``scale * r`` (synchronises; empty unless per_layer).

        Example:
            >>> AdaptiveLossScaleManager().layer_scales
            {}
        """
        eff = (self._scale * self._layer_scales[1:]).tolist()
        return dict(zip(self.layers, eff))

    def instrument(self, module: torch.nn.Module) -> None:
        """With ``per_layer``, give each parameter-owning module of ``module`` its own scale.

        Example:
            >>> AdaptiveLossScaleManager().instrument(torch.nn.Linear(1, 1))  # no-op
        """
        if not self.per_layer:
            return
        if not callable(getattr(module, "add_graph_transform", None)):
            raise ValueError(
                "AdaptiveLossScaleManager(per_layer=True) rewrites the compiled graph: pass it "
                "to ampgraph.build_train_step (or instrument an ampgraph.compile'd module)")
        model = module.original_module
        paths = [path for path, m in model.named_modules()
                 if path and next(m.parameters(recurse=False), None) is not None]
        if self.layers and self.layers != paths:
            raise ValueError(f"AdaptiveLossScaleManager: state has layers {self.layers[:3]}..."
                             f" but the model has {paths[:3]}...: use one manager per model")
        if not self.layers:
            self.layers = paths
            self._layer_scales = torch.ones(len(paths) + 1, device=self._scale.device)
        index = {path: i + 1 for i, path in enumerate(paths)}
        self._region_of = {id(p): index.get(name.rpartition(".")[0], 0)
                           for name, p in model.named_parameters()}
        module.add_graph_transform(partial(insert_grad_scales, layers=index,
                                           make_edge=self._edge))

    def _edge(self, src: int, dst: int) -> Any:
        return GradScaleEdge(self._layer_scales, src, dst).apply

    def _groups(self, params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        groups: list[list[torch.Tensor]] = [[] for _ in range(len(self._layer_scales))]
        for p in params:
            if p.grad is not None:
                groups[self._region_of.get(id(p), 0)].append(p.grad)
        return groups

    # -- the hooks the train step calls -----------------------------------------------------

    def unscale_(self, params: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """Divide each gradient by its region's effective scale; flag inf/NaN in found_inf.

        Example:
            >>> p = torch.nn.Parameter(torch.ones(1)); p.grad = torch.full((1,), 4.0)
            >>> AdaptiveLossScaleManager(4.0).unscale_([p], torch.zeros(())); p.grad.item()
            1.0
        """
        inv = (self._scale.double() * self._layer_scales.double()).reciprocal().float()
        for region, grads in enumerate(self._groups(params)):
            if grads:
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv[region])

    def observe_gradients(self, params: list[torch.Tensor], found_inf: torch.Tensor) -> None:
        """Measure, per region: underflowed and non-zero elements, amax, element count.

        Example:
            >>> p = torch.nn.Parameter(torch.ones(2)); p.grad = torch.tensor([1.0, 1e-9])
            >>> m = AdaptiveLossScaleManager(1.0); m.observe_gradients([p], torch.zeros(()))
            >>> m.update_loss_scale(False); m.get_loss_scale()   # half underflowed: grows
            128.0
        """
        eff = self._scale * self._layer_scales
        rows = []
        with torch.no_grad():
            for region, grads in enumerate(self._groups(params)):
                lo = FP16_TINY / eff[region]
                zero = torch.zeros((), dtype=torch.float64, device=eff.device)
                under, nonzero, numel = zero.clone(), zero.clone(), 0
                for g in grads:
                    a = g.detach().abs()
                    nz = torch.count_nonzero(a)
                    under += torch.count_nonzero(a < lo) - (a.numel() - nz)
                    nonzero += nz
                    numel += a.numel()
                amax = (torch.stack(torch._foreach_norm(grads, math.inf)).max().double()
                        if grads else zero)
                rows.append(torch.stack((under, nonzero, amax, zero + numel)))
        stats = torch.stack(rows)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats, op=dist.ReduceOp.MAX)  # every rank picks the same scales
        self._stats = stats

    def update_loss_scale(self, overflow: bool | torch.Tensor) -> None:
        """Hysteresis backoff on overflow; growth from the last observed statistics.

        Example:
            >>> m = AdaptiveLossScaleManager(4.0, min_loss_scale=2.0, hysteresis=1)
            >>> for _ in range(3):
            ...     m.update_loss_scale(True)
            >>> m.get_loss_scale()
            2.0
        """
        found = overflow_flag(overflow, self._scale) > 0
        scale = self._scale
        left = torch.where(found, self._left - 1, self.hysteresis)
        backoff = found & (left <= 0)
        self._left.copy_(left.clamp_min(1))
        new = torch.where(backoff, (scale * 0.5).clamp_min(self.min_loss_scale), scale)
        stats, self._stats = self._stats, None
        layers = self._layer_scales
        if stats is not None:
            under, nonzero, amax, numel = stats.unbind(1)
            frac = torch.where(nonzero > 0, under / nonzero.clamp_min(1), 1.0)
            amax_scaled = amax * (scale * layers).double()
            k = torch.where(amax_scaled > 0,
                            torch.floor(torch.log2(FP16_MAX / self.headroom / amax_scaled)),
                            math.log2(self.blind_growth)).clamp(max=126)
            grow = (frac > self.underflow_threshold) & (numel > 0) & (k >= 1) & ~found
            factor = torch.where(grow, torch.exp2(k), 1.0).float()
            new = torch.where(grow[0], scale * factor[0], new)
            if len(layers) > 1:  # layers keep their effective scale when the global one grows
                layers[1:] = layers[1:] * factor[1:] / factor[0]
        new = new.clamp(self.min_loss_scale, self.max_loss_scale)
        if len(layers) > 1:
            layers[1:] = torch.minimum(torch.maximum(layers[1:], self.min_loss_scale / new),
                                       self.max_loss_scale / new)
        self._scale.copy_(new)

    # -- state ---------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Scale, bounds, hysteresis counter, threshold, and per-layer factors (one sync).

        Example:
            >>> AdaptiveLossScaleManager().state_dict()["hysteresis_left"]
            2
        """
        return {
            "loss_scale": self.get_loss_scale(), "min_loss_scale": self.min_loss_scale,
            "max_loss_scale": self.max_loss_scale, "hysteresis": self.hysteresis,
            "hysteresis_left": int(self._left.item()),
            "underflow_threshold": self.underflow_threshold, "per_layer": self.per_layer,
            "layers": list(self.layers), "layer_scales": self._layer_scales.tolist(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` in place (exactly: every value is fp32 or int).

        Example:
            >>> a = AdaptiveLossScaleManager(8.0); b = AdaptiveLossScaleManager()
            >>> b.load_state_dict(a.state_dict()); b.get_loss_scale()
            8.0
        """
        self._check_keys(state_dict, _STATE_KEYS)
        fresh = AdaptiveLossScaleManager(
            state_dict["loss_scale"], min_loss_scale=state_dict["min_loss_scale"],
            max_loss_scale=state_dict["max_loss_scale"], hysteresis=state_dict["hysteresis"],
            underflow_threshold=state_dict["underflow_threshold"],
            per_layer=state_dict["per_layer"])
        scales = [float(v) for v in state_dict["layer_scales"]]
        layers = list(state_dict["layers"])
        if len(scales) != len(layers) + 1:
            raise ValueError("AdaptiveLossScaleManager.load_state_dict: layer_scales must have "
                             "one entry per layer plus the global one")
        if self.layers and layers != self.layers:
            raise ValueError("AdaptiveLossScaleManager.load_state_dict: the checkpoint's layers "
                             "differ from this model's")
        for name in ("min_loss_scale", "max_loss_scale", "hysteresis", "underflow_threshold",
                     "per_layer"):
            setattr(self, name, getattr(fresh, name))
        self.custom_unscale = self.per_layer
        self._scale.fill_(fresh.get_loss_scale())
        self._left.fill_(int(state_dict["hysteresis_left"]))
        values = torch.tensor(scales, dtype=torch.float32, device=self._scale.device)
        if self.layers:
            self._layer_scales.copy_(values)  # in place: the graph's ops hold this tensor
        else:
            self.layers, self._layer_scales = layers, values
        self._stats = None

    def __repr__(self) -> str:
        return (f"AdaptiveLossScaleManager(loss_scale={self.get_loss_scale()}, "
                f"min_loss_scale={self.min_loss_scale}, max_loss_scale={self.max_loss_scale}, "
                f"hysteresis={self.hysteresis}, underflow_threshold={self.underflow_threshold}"
                f", per_layer={self.per_layer})")
