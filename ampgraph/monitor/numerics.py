"""``NumericsMonitor``: per-layer underflow/overflow statistics of a mixed-precision run.

Every ``every`` optimizer steps the monitor measures each tracked tensor (gradients after
unscaling; optionally weights, activations, optimizer state) on the device, fetches all of
it with one host transfer, writes a JSON line to ``log_dir/numerics.jsonl`` (and TensorBoard
scalars), and warns with :class:`NumericsWarning` when the history shows a rising underflow
trend, a collapsed loss scale, repeated overflows in a layer or an fp16 Adam state whose eps
cannot be represented. Between logged steps it only keeps the step's (overflow, loss scale)
as a device tensor. docs/monitor.md explains every field.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_leaves

from ampgraph.monitor import sinks as _io
from ampgraph.monitor.history import Diagnosis, History, NumericsWarning, diagnose
from ampgraph.monitor.report import plot_history
from ampgraph.monitor.stats import COLUMNS, Limits, Plan, limits, merge, tensor_stats

__all__ = ["NumericsMonitor", "NumericsWarning"]

TRACKABLE = ("grads", "weights", "activations", "optimizer")
OUTPUT_LAYER = "<output>"  # activations of a compiled model: its outputs only


class NumericsMonitor:
    """Track per-layer numerics of a mixed-precision training run.

    Args:
        every: measure and log every ``every``-th optimizer step (steps 0, every, 2*every...).
        log_dir: write ``numerics.jsonl`` (and TensorBoard events) here; None keeps the
            history in memory only.
        tensorboard: also write TensorBoard scalars (needs ``log_dir`` and the
            ``tensorboard`` package; without it the monitor warns once and goes on).
        track: any of "grads" (after unscaling), "weights", "activations" (forward outputs
            of leaf modules; only the outputs of a model compiled by ``ampgraph.compile``),
            "optimizer" (state tensors shaped like their parameter, e.g. Adam's exp_avg_sq).
        dtype: the low dtype to measure against when the model is not compiled by ampgraph
            (fp16 by default); a compiled model's ``amp_dtype`` is used otherwise.

    Raises:
        ValueError: an argument out of range, or a dtype that contradicts the compiled model.

    Example:
        >>> mon = ampgraph.NumericsMonitor(every=10, log_dir="runs/numerics")  # doctest: +SKIP
        >>> step = ampgraph.build_train_step(model, loss_fn, opt, monitor=mon)  # doctest: +SKIP
        >>> mon.summary()["encoder.layer.0.attention.query"]["underflow_rate"]  # doctest: +SKIP
    """

    def __init__(self, every: int = 10, log_dir: str | os.PathLike[str] | None = None,
                 tensorboard: bool = False, track: Iterable[str] = ("grads",),
                 dtype: str | torch.dtype | None = None) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"NumericsMonitor: every must be an integer >= 1, got {every!r}")
        track = (track,) if isinstance(track, str) else tuple(track)
        unknown = [t for t in track if t not in TRACKABLE]
        if unknown or not track:
            raise ValueError(f"NumericsMonitor: track must be a non-empty subset of "
                             f"{list(TRACKABLE)}, got {list(track)}")
        if not isinstance(tensorboard, bool):
            raise ValueError(f"NumericsMonitor: tensorboard must be True or False, "
                             f"got {tensorboard!r}")
        if tensorboard and log_dir is None:
            raise ValueError("NumericsMonitor: tensorboard=True needs a log_dir for the events")
        self.every, self.track, self.tensorboard = every, track, tensorboard
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._explicit = _io.parse_dtype(dtype)
        self._lim: Limits = limits(self._explicit or torch.float16)
        self.history = History()
        self.diagnoses: list[Diagnosis] = []
        self._model: nn.Module | None = None
        self._checked: nn.Module | None = None  # a compiled twin of _model, already checked
        self._optimizer: torch.optim.Optimizer | None = None
        self._params: list[tuple[str, nn.Parameter]] = []
        self._hooks: list[Any] = []
        self._hooked: nn.Module | None = None
        self._act: dict[str, tuple[list[int], list[int], torch.Tensor]] = {}
        self._plans: dict[tuple, Plan] = {}
        self._pending: list[tuple[int, Any]] = []
        self._step = 0
        self._writer: _io.LogWriter | None = None

    # -- attaching ------------------------------------------------------------------------

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
               ) -> NumericsMonitor:
        """Watch ``model`` (and ``optimizer``) for a hand-written loop; see :meth:`step`.

        ``build_train_step(..., monitor=mon)`` attaches by itself on its first step.

        Example:
            >>> mon = NumericsMonitor(every=10).attach(model, opt)  # doctest: +SKIP
        """
        if isinstance(model, DistributedDataParallel):
            model = model.module
        if not isinstance(model, nn.Module):
            raise ValueError(f"NumericsMonitor.attach: model must be an nn.Module, "
                             f"got {type(model).__name__}")
        if "optimizer" in self.track and optimizer is None:
            raise ValueError("NumericsMonitor: track includes 'optimizer', so attach needs the "
                             "optimizer: mon.attach(model, optimizer)")
        self._model, self._optimizer = model, optimizer
        self._params = list(model.named_parameters())
        self._adopt_dtype(model)
        if "activations" in self.track:
            self._hook_activations(model)
        return self

    def after_backward(self, step_index: int, module: nn.Module,
                       optimizer: torch.optim.Optimizer, loss_scale: torch.Tensor,
                       overflow: torch.Tensor) -> None:
        """Called by ``build_train_step`` after unscaling, before clipping and the update.

        Example:
            >>> step = ampgraph.build_train_step(model, loss_fn, opt, monitor=mon)  # doctest: +SKIP
        """
        if self._model is None:
            self.attach(module, optimizer)
        elif module is not self._model and module is not self._checked:
            ours = {id(p) for _, p in self._params}
            if not {id(p) for p in module.parameters()} <= ours:
                raise ValueError("NumericsMonitor is attached to a different model than this "
                                 "train step's: use one monitor per model")
            self._adopt_dtype(module)
            self._optimizer = self._optimizer or optimizer
            if "activations" in self.track and getattr(module, "amp_dtype", None) is not None \
                    and self._hooked is not module:
                self._hook_activations(module)
            self._checked = module
        self._record(int(step_index), loss_scale, overflow)

    def step(self, loss_scale: Any = None, overflow: bool | torch.Tensor | None = None) -> None:
        """Record one optimizer step of a hand-written loop (after unscaling, before stepping).

        Args:
            loss_scale: the scale this step's backward used: a float, a 0-dim tensor, or the
                ``torch.amp.GradScaler`` itself (then ``overflow`` is read from it as well;
                call ``scaler.unscale_(optimizer)`` first). None means 1.0 (no scaling).
            overflow: whether the gradients were not finite (bool or tensor); None when
                unknown (then only overflows seen on logged steps are counted).

        Raises:
            RuntimeError: not attached, or a GradScaler whose gradients are still scaled.

        Example:
            >>> scaler.unscale_(opt); mon.step(loss_scale=scaler)  # doctest: +SKIP
            >>> scaler.step(opt); scaler.update()  # doctest: +SKIP
        """
        if self._model is None:
            raise RuntimeError("NumericsMonitor.step: call mon.attach(model, optimizer) first "
                               "(or pass monitor=mon to ampgraph.build_train_step)")
        if hasattr(loss_scale, "unscale_") and hasattr(loss_scale, "get_scale"):
            loss_scale, overflow = self._from_scaler(loss_scale, overflow)
        self._record(self._step, loss_scale, overflow)

    # -- results --------------------------------------------------------------------------

    @property
    def skipped_steps(self) -> int:
        """Steps recorded with an overflow (their update was skipped); synchronises."""
        self.flush()
        return self.history.skipped_steps

    @property
    def loss_scale_history(self) -> list[tuple[int, float, bool | None]]:
        """``(step, loss scale, overflow)`` for every recorded step; synchronises."""
        self.flush()
        h = self.history
        return list(zip(h.scale_steps, h.scales, h.overflows))

    def summary(self) -> dict[str, dict[str, Any]]:
        """A dict per layer of the gradients' results, and a dict per other tracked kind.

        Gradient keys: ``underflow_rate``, ``grad_norm``, ``zero_frac`` (latest logged step),
        ``underflow_rate_max`` (over logged steps), ``overflow_count`` (summed over logged
        steps), ``logged_steps``; docs/monitor.md lists the rest.

        Example:
            >>> worst = max(mon.summary().items(), key=lambda kv: kv[1]["underflow_rate"] or 0)
            ... # doctest: +SKIP
        """
        self.flush()
        return self.history.summary()

    def plot(self, path: str | os.PathLike[str]) -> Path:
        """Write a PNG: gradient underflow rate per layer over steps, and the loss scale.

        Needs matplotlib (``pip install 'ampgraph[plot]'``).

        Example:
            >>> mon.plot("numerics.png")  # doctest: +SKIP
        """
        self.flush()
        return plot_history(self.history, path)

    def flush(self) -> None:
        """Fetch and write the loss scales of steps since the last logged step (one sync).

        Example:
            >>> mon.flush()  # doctest: +SKIP
        """
        if not self._pending:
            return
        hist = self._drain(_io.fetch([e for _, e in self._pending if isinstance(e, torch.Tensor)]))
        self._emit({"kind": "scale", "history": hist})

    def close(self) -> None:
        """Flush, remove the activation hooks and close the TensorBoard writer.

        Example:
            >>> mon.close()  # doctest: +SKIP
        """
        self.flush()
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._hooked = [], None
        if self._writer is not None:
            self._writer.close()

    def __repr__(self) -> str:
        return (f"NumericsMonitor(every={self.every}, track={self.track}, "
                f"dtype={self._lim.name}, log_dir={self.log_dir})")

    # -- recording ------------------------------------------------------------------------

    def _adopt_dtype(self, module: nn.Module) -> None:
        amp = module.__dict__.get("amp_dtype")
        if amp not in (torch.float16, torch.bfloat16):
            return
        if self._explicit is not None and self._explicit != amp:
            raise ValueError(f"NumericsMonitor(dtype={limits(self._explicit).name!r}) but the "
                             f"model is compiled for {limits(amp).name}: drop dtype= (the "
                             f"compiled model's dtype is used)")
        self._lim = limits(amp)

    def _from_scaler(self, scaler: Any, overflow: Any) -> tuple[Any, Any]:
        if not scaler.is_enabled():
            return 1.0, overflow
        state = getattr(scaler, "_per_optimizer_states", {}).get(id(self._optimizer), {})
        if getattr(state.get("stage"), "name", "READY") == "READY":  # no state: not unscaled
            raise RuntimeError("NumericsMonitor.step(loss_scale=scaler) needs unscaled "
                               "gradients: call scaler.unscale_(optimizer) before mon.step "
                               "(and before scaler.step)")
        flags = list(state.get("found_inf_per_device", {}).values())
        if overflow is None and flags:
            overflow = flags[0] if len(flags) == 1 else torch.stack(
                [f.to(flags[0].device) for f in flags]).amax()
        scale = getattr(scaler, "_scale", None)
        return (scale if isinstance(scale, torch.Tensor) else scaler.get_scale()), overflow

    def _record(self, step: int, scale: Any, overflow: Any) -> None:
        self._pending.append((step, _io.entry(scale, overflow)))
        self._step = step + 1
        if step % self.every == 0:
            self._log(step, 1.0 if scale is None else scale)

    def _log(self, step: int, scale: Any) -> None:
        parts = self._measure(scale)
        pending = [e for _, e in self._pending if isinstance(e, torch.Tensor)]
        host = _io.fetch([t for _, _, _, _, t in parts] + pending)
        layers: dict[str, dict[str, Any]] = {}
        width = len(COLUMNS)
        for (kind, names, numels, order, _), values in zip(parts, host):
            rows: dict[str, tuple[list[list[float]], list[int]]] = {}
            for row, index in enumerate(order):
                group = rows.setdefault(names[index], ([], []))
                group[0].append(values[row * width:(row + 1) * width])
                group[1].append(numels[index])
            for name in dict.fromkeys(names):  # model order
                layers.setdefault(name, {})[kind] = merge(*rows[name])
        self._act.clear()
        hist = self._drain(host[len(parts):])
        if hist["overflow"] and hist["overflow"][-1] is None and "grads" in self.track:
            hist["overflow"][-1] = any(k.get("grads", {}).get("overflow_count", 0)
                                       for k in layers.values())
        record = {"kind": "step", "step": step, "loss_scale": hist["loss_scale"][-1],
                  "overflow": hist["overflow"][-1],
                  "skipped_steps": self.history.skipped_steps + sum(
                      1 for o in hist["overflow"] if o),
                  "history": hist, "layers": layers}
        if "optimizer" in self.track and self._optimizer is not None:
            record["optimizer"] = _io.optimizer_info(self._optimizer)
        self._emit(record)
        for d in diagnose(self.history):
            if d.key not in {x.key for x in self.diagnoses}:
                self.diagnoses.append(d)
                warnings.warn(d.message, NumericsWarning, stacklevel=4)

    def _measure(self, scale: Any) -> list[tuple[str, list[str], list[int], list[int], Any]]:
        """(kind, layer per tensor, numels, tensor of each row, device stats) per tracked kind."""
        parts = []
        named = self._params
        if "grads" in self.track:
            pairs = [(_io.layer_name(n), p.grad) for n, p in named if p.grad is not None]
            parts += self._stats("grads", pairs, scale)
        if "weights" in self.track:
            parts += self._stats("weights", [(_io.layer_name(n), p) for n, p in named], 1.0)
        if "optimizer" in self.track and self._optimizer is not None:
            by_key: dict[str, list[tuple[str, torch.Tensor]]] = {}
            for n, p in named:
                for key, value in self._optimizer.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor) and value.is_floating_point() and (
                            value.shape == p.shape):
                        by_key.setdefault(key, []).append((_io.layer_name(n), value))
            for key, pairs in by_key.items():
                parts += self._stats(f"optimizer.{key}", pairs, 1.0)
        for layer, (numels, owner, stats) in self._act.items():
            parts.append(("activations", [layer] * len(numels), numels, owner, stats))
        return parts

    def _stats(self, kind: str, pairs: Sequence[tuple[str, torch.Tensor]], scale: Any) -> list:
        by_device: dict[torch.device, list[tuple[str, torch.Tensor]]] = {}
        for name, t in pairs:
            if t.numel():
                by_device.setdefault(t.device, []).append((name, t))
        out = []
        for device, group in by_device.items():
            tensors = [t for _, t in group]
            plan = self._plan(device, [t.numel() for t in tensors])
            s = scale.to(device) if isinstance(scale, torch.Tensor) else float(scale)
            out.append((kind, [n for n, _ in group], [t.numel() for t in tensors], plan.order,
                        tensor_stats(tensors, plan, s, self._lim)))
        return out

    def _plan(self, device: torch.device, numels: list[int]) -> Plan:
        key = (device, tuple(numels))
        if key not in self._plans:
            if len(self._plans) > 64:
                self._plans.clear()
            self._plans[key] = Plan(numels, device)
        return self._plans[key]

    def _drain(self, fetched: list[list[float]]) -> dict[str, list[Any]]:
        values = iter(fetched)
        hist: dict[str, list[Any]] = {"step": [], "loss_scale": [], "overflow": []}
        for step, entry in self._pending:
            flag, scale = next(values) if isinstance(entry, torch.Tensor) else entry
            hist["step"].append(step)
            hist["loss_scale"].append(float(scale))
            hist["overflow"].append(None if math.isnan(flag) else bool(flag))
        self._pending.clear()
        return hist

    def _emit(self, record: dict[str, Any]) -> None:
        if self._writer is None:  # the first record of the run: a header, a fresh file
            start = {"kind": "start", "version": 1, "dtype": self._lim.name, "every": self.every,
                     "track": list(self.track)}
            self.history.add(start)
            self._writer = _io.LogWriter(self.log_dir, self.tensorboard, start)
        self.history.add(record)
        self._writer.write(record)

    def _hook_activations(self, model: nn.Module) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks, self._hooked = [], model
        if model.__dict__.get("amp_dtype") is not None:  # compiled: the graph replaces forward
            warnings.warn(
                "NumericsMonitor: a model compiled by ampgraph runs its captured graph, not "
                "its submodules' forward, so per-layer activations cannot be hooked; only the "
                f"model's outputs are tracked (as {OUTPUT_LAYER!r})", NumericsWarning,
                stacklevel=3)
            self._hooks.append(model.register_forward_hook(self._hook(OUTPUT_LAYER)))
            return
        for name, sub in model.named_modules():
            if not any(True for _ in sub.children()):
                self._hooks.append(sub.register_forward_hook(self._hook(name or _io.ROOT_LAYER)))

    def _hook(self, layer: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not module.training or self._step % self.every:
                return
            outs = [t for t in tree_leaves(output) if isinstance(
                t, torch.Tensor) and t.is_floating_point() and t.numel()]
            if not outs:
                return
            numels = [t.numel() for t in outs]
            plan = self._plan(outs[0].device, numels)
            self._act[layer] = (numels, plan.order, tensor_stats(outs, plan, 1.0, self._lim))

        return hook
