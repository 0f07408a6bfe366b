"""Build the :class:`~ampgraph.cli.render.Inspection` of a PyTorch or ONNX target."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Any

from ampgraph.cli.render import Inspection, summarize
from ampgraph.cli.target import CliError, Target, one_line, quiet


def inspect_target(target: Target, args: argparse.Namespace,
                   loaded: tuple[Any, tuple] | None) -> tuple[Inspection, Inspection | None]:
    """The inspection at ``args.level`` and, with ``--diff``, at the other level.

    Example:
        >>> base, other = inspect_target(parse_target("model.onnx"), args, None)
    """
    levels = [args.level] + ([args.diff] if args.diff else [])
    if target.kind == "onnx":
        found = _onnx(target, args, levels)
    else:
        model, inputs = loaded
        found = [inspect_module(target.spec, model, inputs, level, args.dtype or "auto",
                                args.train, bool(getattr(args, "debug", False)),
                                fp8=getattr(args, "fp8", None))
                 for level in levels]
    return found[0], (found[1] if len(found) > 1 else None)


def inspect_module(spec: str, model: Any, inputs: tuple, level: str, dtype: str,
                   train: bool, debug: bool = False, fp8: Any = None) -> Inspection:
    """Compile ``model`` at ``level`` (with ``fp8``: an ``FP8Recipe``, or the scaling of
    the default one), capture it on ``inputs`` and collect the report."""
    import torch

    import ampgraph
    from ampgraph.cli.analysis import fx_stats, fx_view

    try:
        recipe = None if fp8 is None or level == "O0" else (
            fp8 if isinstance(fp8, ampgraph.FP8Recipe) else ampgraph.FP8Recipe(scaling=fp8))
        net = ampgraph.compile(model, amp_level=level, dtype=dtype, fp8=recipe)
    except ValueError as exc:
        raise CliError(one_line(exc)) from exc
    net.train(train)
    with quiet(not debug):
        report = ampgraph.explain(net, *inputs)
    graphs, eager = net.amp_parts()
    shapes = [list(t.shape) for t in inputs if isinstance(t, torch.Tensor)]
    summary = summarize(report.nodes, report.casts, fx_stats(graphs),
                        mode="train" if train else "eval", input_shapes=shapes,
                        eager_modules=[asdict(e) for e in eager])
    return Inspection(spec, "torch", level, report.dtype, report.nodes, report.casts, summary,
                      fx_view(graphs, net.amp_dtype))


def _onnx(target: Target, args: argparse.Namespace, levels: list[str]) -> list[Inspection]:
    from ampgraph.cli.onnx_io import convert, input_shapes, load, onnx_rows, onnx_stats, onnx_view

    dtype = "fp16" if args.dtype in (None, "auto") else args.dtype
    model = load(target.source)
    fixed = input_shapes(model, args.input_shape)
    out = []
    for level in levels:
        result = convert(model, level, dtype)
        low = "fp32" if level == "O0" else dtype
        rows = onnx_rows(model, result, low, fixed)
        summary = summarize(rows, result.casts, onnx_stats(model, result, fixed),
                            input_shapes=[list(s) for s in fixed.values()],
                            kept_fp32_by_pass=dict(result.forced))
        out.append(Inspection(target.spec, "onnx", level, low, rows, result.casts, summary,
                              onnx_view(result, low)))
    return out
