"""The numerics history ``NumericsMonitor`` keeps (and numerics.jsonl holds), and its diagnoses.

:class:`History` is filled from the same records that are written as JSON lines, so the live
monitor and ``ampgraph monitor-report`` see identical data and :func:`diagnose` gives both
the same answers. The thresholds below are plain data; each says why it has its value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ampgraph.monitor.stats import STAT_FIELDS

__all__ = ["Diagnosis", "History", "NumericsWarning", "diagnose"]

# -- diagnosis thresholds ------------------------------------------------------------------
# A layer losing more than 1% of its non-zero gradients to subnormals/zero is past what
# healthy fp16 runs show (<1% in YOLO or bf16; 5-20% of layers in unstable CLIP runs).
UNDERFLOW_RATE = 0.01
# A trend needs a few logged points; the window keeps old history from hiding a new rise.
TREND_MIN_RECORDS = 3
TREND_WINDOW = 5
# "Rising": the latest rate exceeds the window's first by 25% of it and by 0.5 points.
TREND_RELATIVE, TREND_ABSOLUTE = 0.25, 0.005
# ... and by more than sampling noise: a 128-value bias moves 0.8 points per value, so the
# rise must exceed 3 binomial standard errors of the latest rate.
NOISE_SIGMAS = 3.0
# Below 128 (MindSpore's default fixed scale) gradients under ~5e-7 are already subnormal in
# fp16; a scale that fell there from a higher peak and stays is stuck, not settling.
LOW_SCALE = 128.0
LOW_SCALE_RECORDS = 3
# One overflow is what dynamic scaling is for; the same layer overflowing in 3 logged steps
# is a layer whose values do not fit the low dtype.
OVERFLOW_RECORDS = 3
# Adam's exp_avg_sq held in fp16 with half its values flushed to 0 or below the smallest
# normal: sqrt(v) + eps is 0 there because eps=1e-8 is below fp16's smallest subnormal (6e-8).
ADAM_UNDERFLOW = 0.5
MAX_NAMED = 5  # layers named in one warning


class NumericsWarning(UserWarning):
    """A diagnosis of ``NumericsMonitor``; each distinct one fires once per monitor."""


NumericsWarning.__module__ = "ampgraph.monitor"  # where users import it from


@dataclass(frozen=True)
class Diagnosis:
    """One finding: a stable ``key`` (fires once per monitor), the layers, the message."""

    key: str
    layers: tuple[str, ...]
    message: str


class History:
    """Logged numerics, filled record by record (``start``, ``step`` and ``scale`` records).

    Attributes:
        meta: the ``start`` record (dtype, every, track).
        steps: the logged steps.
        scale_steps, scales, overflows: the loss scale and overflow flag of every step
            (``None`` where the overflow was not reported).
        logged_scales: the loss scale at each logged step.
        series: ``kind -> layer -> field -> list`` aligned with ``series[...]["step"]``.
        optimizer: the latest optimizer info (eps values, state dtypes).
    """

    def __init__(self) -> None:
        self.meta: dict[str, Any] = {}
        self.steps: list[int] = []
        self.scale_steps: list[int] = []
        self.scales: list[float] = []
        self.overflows: list[bool | None] = []
        self.logged_scales: list[float] = []
        self.series: dict[str, dict[str, dict[str, list[Any]]]] = {}
        self.optimizer: dict[str, Any] = {}

    def add(self, record: dict[str, Any]) -> None:
        """Add one record (as written to numerics.jsonl)."""
        kind = record.get("kind")
        if kind == "start":
            self.meta = dict(record)
            return
        hist = record.get("history") or {}
        self.scale_steps += [int(s) for s in hist.get("step", [])]
        self.scales += [float(s) for s in hist.get("loss_scale", [])]
        self.overflows += list(hist.get("overflow", []))
        if kind != "step":
            return
        step = int(record["step"])
        self.steps.append(step)
        self.logged_scales.append(float(record.get("loss_scale", 1.0)))
        for layer, kinds in record.get("layers", {}).items():
            for name, stats in kinds.items():
                series = self.series.setdefault(name, {}).setdefault(layer, {"step": []})
                series["step"].append(step)
                for field in STAT_FIELDS:
                    series.setdefault(field, []).append(stats.get(field))
        if record.get("optimizer"):
            self.optimizer = record["optimizer"]

    @property
    def dtype(self) -> str:
        return str(self.meta.get("dtype", "fp16"))

    @property
    def skipped_steps(self) -> int:
        """Steps whose overflow flag was set (their optimizer update was skipped)."""
        return sum(1 for o in self.overflows if o)

    def summary(self) -> dict[str, dict[str, Any]]:
        """Per layer: the gradient fields, plus a dict per other tracked kind.

        ``underflow_rate``, ``grad_norm``, ``zero_frac``: the latest logged gradients;
        ``underflow_rate_max``: the maximum over logged steps; ``overflow_count``: the total
        over logged steps. Other kinds ("weights", "activations", "optimizer.exp_avg_sq")
        map to their latest statistics plus ``overflow_total`` and ``underflow_rate_max``.
        """
        out: dict[str, dict[str, Any]] = {}
        for kind, layers in self.series.items():
            for layer, s in layers.items():
                row = out.setdefault(layer, {"underflow_rate": None, "underflow_rate_max": None,
                                             "overflow_count": None, "grad_norm": None,
                                             "zero_frac": None, "logged_steps": 0})
                rates = [r for r in s["underflow_rate"] if r is not None]
                total = sum(int(c or 0) for c in s["overflow_count"])
                if kind == "grads":
                    row.update(underflow_rate=s["underflow_rate"][-1],
                               underflow_rate_max=max(rates, default=0.0), overflow_count=total,
                               grad_norm=s["norm"][-1], zero_frac=s["zero_frac"][-1],
                               logged_steps=len(s["step"]))
                else:
                    latest = {f: s[f][-1] for f in STAT_FIELDS}
                    row[kind] = {**latest, "underflow_rate_max": max(rates, default=0.0),
                                 "overflow_total": total}
        return out


def diagnose(history: History) -> list[Diagnosis]:
    """Everything wrong with ``history`` now (the monitor warns once per ``key``).

    Example:
        >>> diagnose(History())
        []
    """
    found = [_underflow_rising(history), _scale_stuck_low(history), _repeated_overflow(history),
             _adam_eps(history)]
    return [d for d in found if d is not None]


def _names(layers: list[str]) -> str:
    more = len(layers) - MAX_NAMED
    text = ", ".join(layers[:MAX_NAMED])
    return text + (f" and {more} more" if more > 0 else "")


def _fp32_overrides(layers: list[str]) -> str:
    return "module_overrides={" + ", ".join(f"{x!r}: 'fp32'" for x in layers[:3]) + "}"


def _tiny(dtype: str) -> float:
    return 2.0**-14 if dtype == "fp16" else 2.0**-126


def _scale_remedy(history: History, collapse: bool) -> str:
    """The "minimum loss scale" remedy with a concrete power of two, or why it cannot help.

    Upper bounds: the largest parameter gradient's headroom to half of fp16's maximum; and
    for an underflow trend, half the lowest scale that overflowed (gradients inside the graph
    can overflow before the parameter gradients do); after a collapse, the highest scale that
    ran without overflow (a floor there skips the overflowing steps instead of collapsing).
    """
    if history.dtype != "fp16":
        return "set a minimum loss scale (e.g. DynamicLossScaleManager(min_loss_scale=1024))"
    grads = history.series.get("grads", {})
    biggest = max((m for s in grads.values() for m in s["max_abs"][-1:] if m), default=0.0)
    bounds = []
    if biggest > 0:
        bounds.append((math.floor(math.log2(65504.0 / 2 / biggest)),
                       f"the largest gradient ({biggest:.2g}) leaves room up to that"))
    pairs = list(zip(history.scales, history.overflows))
    if collapse:
        clean = [s for s, o in pairs if o is False]
        if clean:
            best = math.floor(math.log2(max(clean)))
            bounds.append((best, f"2**{best} ran without overflow before"))
    else:
        overflowed = [s for s, o in pairs if o]
        if overflowed:
            lowest = math.floor(math.log2(min(overflowed)))
            bounds.append((lowest - 1, f"the lowest scale that overflowed was 2**{lowest}"))
    if not bounds:
        return "set a minimum loss scale (e.g. DynamicLossScaleManager(min_loss_scale=1024))"
    exponent, why = min(bounds)
    current = history.logged_scales[-1] if history.logged_scales else 1.0
    if 2.0**exponent <= current:
        return f"a higher loss scale is not available ({why}; the scale is {current:g})"
    return (f"set a minimum loss scale of 2**{exponent} (DynamicLossScaleManager("
            f"min_loss_scale=2**{exponent}), or clamp GradScaler's scale after update(); {why})")


def _underflow_rising(history: History) -> Diagnosis | None:
    rising: list[tuple[str, float, float]] = []
    for layer, s in history.series.get("grads", {}).items():
        rates = [r for r in s["underflow_rate"][-TREND_WINDOW:] if r is not None]
        if len(rates) < TREND_MIN_RECORDS:
            continue
        first, last = rates[0], rates[-1]
        nonzero = (s["numel"][-1] or 0) * (1.0 - (s["zero_frac"][-1] or 0.0))
        noise = NOISE_SIGMAS * math.sqrt(last * (1.0 - last) / max(nonzero, 1.0))
        if last >= UNDERFLOW_RATE and last - first >= max(TREND_RELATIVE * first,
                                                          TREND_ABSOLUTE, noise):
            rising.append((layer, first, last))
    if not rising:
        return None
    rising.sort(key=lambda r: -r[2])
    layers = [r[0] for r in rising]
    shown = ", ".join(f"{n} ({a:.1%} -> {b:.1%})" for n, a, b in rising[:MAX_NAMED])
    more = f" and {len(rising) - MAX_NAMED} more" if len(rising) > MAX_NAMED else ""
    scale = history.logged_scales[-1] if history.logged_scales else 1.0
    dtype = history.dtype
    return Diagnosis("underflow_rising", tuple(layers), (
        f"ampgraph numerics: the {dtype} gradient underflow rate is rising in {len(rising)} "
        f"layer(s): {shown}{more}. At loss scale {scale:g} these gradients fall below "
        f"{dtype}'s smallest normal ({_tiny(dtype):.2g}) and lose precision or flush to zero. "
        f"Remedies: switch to bf16 (ampgraph.compile(model, dtype='bf16'): fp32's exponent "
        f"range, no loss scaling); {_scale_remedy(history, collapse=False)}; or "
        f"keep these layers in FP32 with {_fp32_overrides(layers)}."))


def _overflowing_layers(history: History) -> list[tuple[str, int, int]]:
    """(layer, logged steps with overflows, values) over gradients and activations."""
    rows: dict[str, list[int]] = {}
    for kind in ("grads", "activations"):
        for layer, s in history.series.get(kind, {}).items():
            counts = [int(c or 0) for c in s["overflow_count"]]
            row = rows.setdefault(layer, [0, 0])
            row[0] = max(row[0], sum(1 for c in counts if c))
            row[1] += sum(counts)
    found = [(layer, k, n) for layer, (k, n) in rows.items() if k]
    return sorted(found, key=lambda r: (-r[1], -r[2]))


def _scale_stuck_low(history: History) -> Diagnosis | None:
    recent = history.logged_scales[-LOW_SCALE_RECORDS:]
    if len(recent) < LOW_SCALE_RECORDS or max(recent) >= LOW_SCALE:
        return None
    peak = max(history.scales + history.logged_scales)
    if peak <= recent[-1]:  # a fixed low scale chosen on purpose, not a collapse
        return None
    culprits = _overflowing_layers(history)
    layers = [c[0] for c in culprits]
    if layers:
        who = (f"layers with overflows: {_names(layers)}; keep them in FP32 with "
               f"{_fp32_overrides(layers)}")
    elif history.skipped_steps:
        who = ("no logged layer overflowed, so the overflows fall between logged steps (lower "
               "`every`) or in the loss")
    else:
        who = ("no overflow was recorded: the scale was set low by hand, or mon.step() was not "
               "given the overflow flag")
    return Diagnosis("loss_scale_low", tuple(layers), (
        f"ampgraph numerics: the loss scale collapsed to {recent[-1]:g} (peak {peak:g}) and "
        f"stayed below {LOW_SCALE:g} for the last {LOW_SCALE_RECORDS} logged steps; "
        f"{history.skipped_steps} of {len(history.scales)} steps overflowed and were skipped. "
        f"At this scale small gradients underflow in {history.dtype}. Remedies: {who}; "
        f"{_scale_remedy(history, collapse=True)}; or switch to bf16 "
        f"(ampgraph.compile(model, dtype='bf16'))."))


def _repeated_overflow(history: History) -> Diagnosis | None:
    culprits = [c for c in _overflowing_layers(history) if c[1] >= OVERFLOW_RECORDS]
    if not culprits:
        return None
    layers = [c[0] for c in culprits]
    shown = ", ".join(f"{n} ({k} logged steps, {v} values)" for n, k, v in culprits[:MAX_NAMED])
    more = f" and {len(culprits) - MAX_NAMED} more" if len(culprits) > MAX_NAMED else ""
    return Diagnosis("repeated_overflow", tuple(layers), (
        f"ampgraph numerics: repeated overflows in {len(culprits)} layer(s): {shown}{more}. "
        f"Their values do not fit {history.dtype}'s range at the loss scale. Remedies: keep "
        f"these layers in FP32 with {_fp32_overrides(layers)}, or switch to bf16 "
        f"(ampgraph.compile(model, dtype='bf16'))."))


def _adam_eps(history: History) -> Diagnosis | None:
    info = history.optimizer
    if history.dtype != "fp16" or "float16" not in info.get("state_dtypes", []):
        return None
    eps = [e for e in info.get("eps", []) if e is not None]
    if not eps or min(eps) >= 2.0**-14:
        return None
    low = []
    for layer, s in history.series.get("optimizer.exp_avg_sq", {}).items():
        zeros, rate = s["zero_frac"][-1] or 0.0, s["underflow_rate"][-1] or 0.0
        if zeros + (1.0 - zeros) * rate >= ADAM_UNDERFLOW:  # flushed to 0 or subnormal
            low.append(layer)
    if not low:
        return None
    layers = low
    return Diagnosis("adam_eps", tuple(layers), (
        f"ampgraph numerics: Adam's exp_avg_sq is zero or below fp16's smallest normal "
        f"(6.1e-05) for most values in {len(low)} layer(s): {_names(layers)}. The state is fp16 "
        f"and eps={min(eps):g} rounds to 0 in fp16 (smallest subnormal 6e-08), so where v "
        f"flushes to 0, sqrt(v) + eps is 0 and the update divides by zero; subnormal v loses "
        f"precision. Remedies: raise Adam eps (e.g. eps=1e-4), "
        f"or keep the optimizer state in FP32 (fp32 master weights, as "
        f"ampgraph.build_train_step does)."))
