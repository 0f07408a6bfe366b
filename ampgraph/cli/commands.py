"""The ``ampgraph`` subcommands: each ``cmd_*`` takes the parsed arguments, returns an exit code.

Heavy imports (onnx, the analysis, matplotlib) happen inside the command that needs them, so
``ampgraph --help`` stays fast. The argument parser is ``ampgraph.cli.main``.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

from ampgraph.cli.target import (
    CliError,
    build_model,
    make_inputs,
    one_line,
    parse_target,
)


def _load_factory(args: argparse.Namespace, target: Any, train: bool = False) -> tuple[Any, tuple]:
    """Build the model, make its inputs and check that it runs on them (fp32, eager) in the
    mode the command uses (train or eval)."""
    import torch

    model, module = build_model(target)
    model.train(train)
    inputs = make_inputs(module, args.input_shape, args.input_dtype, args.int_high)
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.no_grad():
            model(*inputs)
    except Exception as exc:
        shapes = ", ".join("x".join(map(str, t.shape)) if isinstance(t, torch.Tensor)
                           else type(t).__name__ for t in inputs)
        raise CliError(f"the model fails on inputs ({shapes}): {one_line(exc)}; check "
                       "--input-shape/--input-dtype") from exc
    finally:
        with torch.no_grad():
            for b, value in saved:
                b.copy_(value)
    return model, inputs


def cmd_inspect(args: argparse.Namespace) -> int:
    """``ampgraph inspect``: per-node precision report in table/json/dot/html."""
    from ampgraph.cli.inspect import inspect_target
    from ampgraph.cli.render import diff, to_dot, to_json, to_table, use_color

    target = parse_target(args.target)
    if target.kind == "onnx":
        if args.input_dtype:
            raise CliError("--input-dtype does not apply to .onnx targets (input types come "
                           "from the model)")
        base, other = inspect_target(target, args, None)
    else:
        base, other = inspect_target(target, args, _load_factory(args, target, args.train))
    if other is not None:
        base.diff = diff(base, other)
    if args.format == "json":
        text = to_json(base)
    elif args.format == "dot":
        text = to_dot(base)
    elif args.format == "html":
        from ampgraph.cli.html_report import to_html

        text = to_html(base)
    else:
        text = to_table(base, color=args.output is None and use_color())
    if args.output:
        Path(args.output).write_text(text, encoding="utf-8")
        print(f"wrote {args.output} ({args.format}, {len(base.nodes)} nodes, {base.casts} casts)")
    else:
        sys.stdout.write(text)
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    """``ampgraph convert``: the ONNX pass on a file, optionally validated."""
    from ampgraph.cli.onnx_io import load, random_feeds
    from ampgraph.onnx import convert_onnx, validate_onnx

    target = parse_target(args.input)
    if target.kind != "onnx":
        raise CliError(f"{args.input}: convert takes an .onnx file (use 'ampgraph export' "
                       "for PyTorch models)")
    if not args.output.lower().endswith(".onnx"):
        raise CliError(f"{args.output}: the output must be an .onnx file")
    original = load(args.input)
    try:
        converted = convert_onnx(args.input, args.level, args.dtype,
                                 keep_io_types=args.keep_io_types, op_block_list=args.block_op,
                                 node_block_list=args.block_node, output_path=args.output)
    except ValueError as exc:
        raise CliError(one_line(exc)) from exc
    dtype = "fp32" if args.level == "O0" else args.dtype
    print(_onnx_summary(original, converted, args.output, args.level, dtype))
    if not args.validate:
        return 0
    feeds = random_feeds(original, args.input_shape, args.int_high)
    report = validate_onnx(args.input, args.output, feeds, rtol=args.rtol, atol=args.atol)
    shapes = ", ".join(f"{k} {'x'.join(map(str, v.shape))}" for k, v in feeds.items())
    print(f"validation on random inputs ({shapes}), rtol {args.rtol:g}, atol {args.atol:g}:")
    print(report)
    if not report.passed:
        print(f"ampgraph convert: validation failed: max relative error {report.max_rel:.3g}",
              file=sys.stderr)
        return 1
    return 0


def _onnx_summary(original: Any, converted: Any, path: str, level: str, dtype: str) -> str:
    from ampgraph.cli.render import human_bytes
    from passes.onnx.subgraphs import all_graphs

    def count(model: Any, op: str | None = None) -> int:
        return sum(1 for g in all_graphs(model.graph) for n in g.node
                   if op is None or n.op_type == op)

    size = Path(path).stat().st_size
    casts = count(converted, "Cast") - count(original, "Cast")
    return (f"wrote {path} ({level} {dtype}): {count(original)} -> {count(converted)} nodes, "
            f"{casts:+d} Cast nodes, {human_bytes(original.ByteSize())} -> "
            f"{human_bytes(size)} on disk")


def cmd_export(args: argparse.Namespace) -> int:
    """``ampgraph export``: torch.onnx export of the fp32 model + the ONNX pass."""
    from ampgraph.cli.onnx_io import load
    from ampgraph.onnx import export_onnx

    target = parse_target(args.target)
    if target.kind == "onnx":
        raise CliError(f"{args.target} is already ONNX: use 'ampgraph convert'")
    if not args.output.lower().endswith(".onnx"):
        raise CliError(f"{args.output}: the output must be an .onnx file")
    model, inputs = _load_factory(args, target)
    try:
        export_onnx(model, inputs, args.output, args.level, args.dtype,
                    keep_io_types=args.keep_io_types, opset=args.opset)
    except ValueError as exc:
        raise CliError(one_line(exc)) from exc
    out = load(args.output)
    casts = sum(1 for n in out.graph.node if n.op_type == "Cast")
    ins = ", ".join(f"{vi.name}" for vi in out.graph.input)
    dtype = "fp32" if args.level == "O0" else args.dtype
    opset = next(o.version for o in out.opset_import if o.domain in ("", "ai.onnx"))
    print(f"wrote {args.output} ({args.level} {dtype}, opset {opset}): "
          f"{len(out.graph.node)} nodes, "
          f"{casts} Cast nodes, inputs {ins}, {Path(args.output).stat().st_size} bytes")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``ampgraph bench``: step times and peak memory per variant."""
    import json

    import torch

    from ampgraph.cli import bench as _cli_bench
    from ampgraph.config import AmpConfig, dtype_name

    target = parse_target(args.target)
    if target.kind == "onnx":
        raise CliError("bench takes a PyTorch factory (file.py:function), not an .onnx file")
    if args.steps < 1 or args.warmup < 0:
        raise CliError("--steps must be >= 1 and --warmup >= 0")
    if args.threads is not None:
        if args.threads < 1:
            raise CliError("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise CliError("--device cuda but CUDA is not available; use --device cpu")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available()
                          else "cpu")
    model, inputs = _load_factory(args, target, args.train)
    model.to(device)
    inputs = tuple(t.to(device) if isinstance(t, torch.Tensor) else t for t in inputs)
    low = AmpConfig.create(dtype=args.dtype).resolve(device).dtype  # the levels' low dtype
    variants = _cli_bench.run(model, inputs, args.levels, low, device, args.steps, args.warmup,
                              args.train, hide_capture_output=not getattr(args, "debug", False))
    records = _cli_bench.results(variants)
    info = {"schema": "ampgraph.bench/1", "target": args.target, "device": str(device),
            "dtype": dtype_name(low), "mode": "train" if args.train else "eval",
            "steps": args.steps, "warmup": args.warmup, "threads": torch.get_num_threads(),
            "memory_method": _cli_bench.MEMORY_METHOD[device.type], "results": records}
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(f"ampgraph bench {args.target}: {info['mode']}, {device}, {info['dtype']}, "
              f"{args.steps} steps after {args.warmup} warm-up, threads {info['threads']}")
        print(_cli_bench.table(records))
        print(f"peak memory: {info['memory_method']}")
    return 0 if all("error" not in r for r in records) else 1


def cmd_monitor_report(args: argparse.Namespace) -> int:
    from ampgraph.monitor.report import (
        LOG_NAME,
        ReportError,
        format_report,
        load_history,
        plot_history,
    )

    try:
        history = load_history(args.log_dir)
        if args.plot and importlib.util.find_spec("matplotlib") is None:
            raise ReportError("--plot needs matplotlib: pip install 'ampgraph[plot]'")
    except ReportError as exc:
        raise CliError(str(exc)) from exc
    print(f"ampgraph monitor-report: {Path(args.log_dir) / LOG_NAME}")
    print(format_report(history, top=max(1, args.top)))
    if args.plot:
        print(f"wrote {plot_history(history, args.plot)}")
    return 0
