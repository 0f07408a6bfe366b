"""Reading numerics.jsonl back, the text summary and the PNG plot (``ampgraph monitor-report``).

matplotlib is imported only inside :func:`plot_history` (``pip install 'ampgraph[plot]'``);
the figure is drawn with ``matplotlib.figure.Figure`` so no global backend is switched.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ampgraph.monitor.history import History, diagnose

__all__ = ["LOG_NAME", "ReportError", "format_report", "load_history", "plot_history"]

PLOT_LAYERS = 8  # lines in the underflow panel: the layers with the highest peak rate
LOG_NAME = "numerics.jsonl"


class ReportError(ValueError):
    """A log directory that cannot be reported on (missing, empty, not a numerics log)."""


def load_history(log_dir: str | os.PathLike[str]) -> History:
    """Read ``log_dir/numerics.jsonl`` into a :class:`History`.

    Raises:
        ReportError: the directory or file is missing, or holds no logged step.

    Example:
        >>> load_history("runs/numerics").steps[:3]  # doctest: +SKIP
        [0, 10, 20]
    """
    path = Path(log_dir)
    if not path.is_dir():
        raise ReportError(f"{path}: no such log directory (the NumericsMonitor log_dir)")
    file = path / LOG_NAME
    if not file.is_file():
        raise ReportError(f"{path}: no {LOG_NAME} in it; was the NumericsMonitor given "
                          f"log_dir={str(path)!r} and did it reach a logged step?")
    history = History()
    with open(file) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                history.add(json.loads(line))
            except (ValueError, KeyError, TypeError) as exc:
                raise ReportError(f"{file}:{number}: not a numerics record ({exc})") from exc
    if not history.steps:
        raise ReportError(f"{file}: no logged step yet (the monitor logs every `every` steps)")
    return history


def _pct(value: Any) -> str:
    return "-" if value is None else f"{100 * value:.2f}%"


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}"


def format_report(history: History, top: int = 20) -> str:
    """A plain-text summary: run, loss scale, per-layer table per kind, diagnoses.

    Example:
        >>> print(format_report(load_history("runs/numerics")))  # doctest: +SKIP
    """
    meta = history.meta
    lines = [
        f"dtype {history.dtype}, logged every {meta.get('every', '?')} steps, tracked: "
        f"{', '.join(meta.get('track', [])) or '?'}; {len(history.steps)} logged steps "
        f"({history.steps[0]}..{history.steps[-1]}), {len(history.scales)} steps recorded",
    ]
    if history.scales:
        lines.append(
            f"loss scale: last {history.scales[-1]:g}, min {min(history.scales):g}, max "
            f"{max(history.scales):g}; skipped steps (overflow): {history.skipped_steps}")
    header = (f"{'layer':40} {'underflow':>10} {'peak':>10} {'overflows':>10} {'norm':>10} "
              f"{'zeros':>8}")
    for kind, layers in history.series.items():
        rows = []
        for layer, s in layers.items():
            rates = [r for r in s["underflow_rate"] if r is not None]
            total = sum(int(c or 0) for c in s["overflow_count"])
            rows.append((max(rates, default=0.0), total, layer, s))
        rows.sort(key=lambda r: (-r[0], -r[1], r[2]))
        lines += ["", f"{kind} (latest logged step; peak underflow and overflows over all "
                      f"logged steps), {len(rows)} layers:", header]
        for peak, total, layer, s in rows[:top]:
            lines.append(f"{layer[-40:]:40} {_pct(s['underflow_rate'][-1]):>10} "
                         f"{_pct(peak):>10} {total:>10} {_num(s['norm'][-1]):>10} "
                         f"{_pct(s['zero_frac'][-1]):>8}")
        if len(rows) > top:
            lines.append(f"... {len(rows) - top} more layers (--top N)")
    found = diagnose(history)
    lines += ["", "diagnoses:" if found else "diagnoses: none"]
    lines += [f"- {d.message}" for d in found]
    return "\n".join(lines)


def plot_history(history: History, path: str | os.PathLike[str],
                 layers: int = PLOT_LAYERS) -> Path:
    """Write a PNG: gradient underflow rate of the worst layers over steps, loss scale below.

    Raises:
        ImportError: matplotlib is not installed.
        ValueError: nothing is logged yet.

    Example:
        >>> plot_history(load_history("runs/numerics"), "numerics.png")  # doctest: +SKIP
    """
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("plotting needs matplotlib: pip install 'ampgraph[plot]' "
                          "(or pip install matplotlib)") from exc
    if not history.steps and not history.scales:
        raise ValueError("nothing to plot yet: the monitor has not logged a step")
    kind = "grads" if "grads" in history.series else next(iter(history.series), None)
    fig = Figure(figsize=(8, 6), dpi=100, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    series = history.series.get(kind, {}) if kind else {}
    ranked = sorted(series.items(), key=lambda kv: -max(
        [r for r in kv[1]["underflow_rate"] if r is not None], default=0.0))
    for layer, s in ranked[:layers]:
        rates = [100 * (r or 0.0) for r in s["underflow_rate"]]
        top.plot(s["step"], rates, marker="o", markersize=3, label=layer)
    shown = f"top {layers} of {len(ranked)} layers" if len(ranked) > layers else "all layers"
    top.set_ylabel(f"{kind or 'grads'} underflow rate (%)")
    top.set_title(f"NumericsMonitor ({history.dtype}): {kind or 'grads'} underflow rate per "
                  f"layer, {shown} by peak", fontsize=10)
    if ranked:
        top.legend(fontsize=7, loc="upper left", ncols=2)
    top.grid(alpha=0.3)
    if history.scales:
        bottom.step(history.scale_steps, history.scales, where="post", color="tab:blue",
                    label="loss scale")
        skipped = [(s, v) for s, v, o in zip(history.scale_steps, history.scales,
                                             history.overflows) if o]
        if skipped:
            bottom.scatter([s for s, _ in skipped], [v for _, v in skipped], color="tab:red",
                           marker="x", zorder=3, label=f"overflow, skipped ({len(skipped)})")
        bottom.set_yscale("log", base=2)
        bottom.legend(fontsize=7, loc="lower right")
    bottom.set_ylabel("loss scale")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return out
