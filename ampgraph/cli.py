"""The ``ampgraph`` command line: inspect, convert, export, bench, monitor-report.

TARGET is an ``.onnx`` file or a factory returning an ``nn.Module``:
``path/to/file.py:function`` (``path/to/file.py`` alone means ``:make_model``) or
``package.module:function``. Inputs come from ``--input-shape`` (one per positional input)
or from ``example_inputs()`` in the factory's module. User errors print one line on stderr
and exit with code 2 (``--debug`` adds the traceback); other failures exit with code 1.
See docs/cli.md.

Example:
    $ ampgraph inspect models/lenet5.py:make_model --level O2 --format json
    $ ampgraph convert model.onnx model_fp16.onnx --block-op Softmax --validate
"""

from __future__ import annotations

import argparse
import sys
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ampgraph._cli_target import (
    CliError,
    build_model,
    make_inputs,
    one_line,
    parse_dtype,
    parse_level,
    parse_levels,
    parse_shape,
    parse_target,
)

FORMATS = ("table", "json", "dot", "html")


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (exit code 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _arg(parse: Any) -> Any:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except CliError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = parse.__name__.removeprefix("parse_")
    return convert


def _add_inputs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("inputs (default: example_inputs() of the factory's module)")
    g.add_argument("--input-shape", action="append", default=[], metavar="SHAPE",
                   type=_arg(parse_shape),
                   help="shape of one positional input, e.g. 2,3,32,32 (repeat per input)")
    g.add_argument("--input-dtype", action="append", default=[], metavar="DTYPE",
                   type=_arg(parse_dtype),
                   help="dtype of the inputs (once for all, or once per --input-shape), e.g. "
                        "int64 for token ids; default float32")
    g.add_argument("--int-high", type=int, default=2, metavar="N",
                   help="integer inputs are drawn from [0, N) (default 2: valid token ids "
                        "and attention masks)")


def _add_onnx_output(p: argparse.ArgumentParser, level: dict) -> None:
    """Options shared by the commands that write an ONNX file."""
    p.add_argument("--level", **level)
    p.add_argument("--dtype", default="fp16", choices=("fp16", "bf16"), help="default fp16")
    p.add_argument("--keep-io-types", action=argparse.BooleanOptionalAction, default=True,
                   help="keep the graph inputs/outputs in their dtypes (default: keep)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``ampgraph`` command.

    Example:
        >>> args = build_parser().parse_args(["inspect", "models/lenet5.py:make_model"])
        >>> args.level
        'O2'
    """
    from ampgraph import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the traceback of an error")
    parser = _Parser(prog="ampgraph", description="Graph-level automatic mixed precision "
                     "(MindSpore-style O0-O3) for PyTorch and ONNX models.",
                     epilog="TARGET: file.py:function | package.module:function | model.onnx")
    parser.add_argument("--version", action="version", version=f"ampgraph {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser,
                                required=True)
    level = {"type": _arg(parse_level), "default": "O2", "metavar": "LEVEL",
             "help": "AMP level O0 (fp32), O1 (allow-list ops low), O2 (all but the deny "
                     "list low, default), O3 (all low)"}

    p = sub.add_parser("inspect", parents=[common], help="show which node runs in which "
                       "precision, and why", description="Show, per graph node, the precision "
                       "a level assigns and why, with a summary (casts, FLOP share, bytes).")
    p.add_argument("target", metavar="TARGET")
    p.add_argument("--level", **level)
    p.add_argument("--dtype", default=None, choices=("auto", "bf16", "fp16"),
                   help="low dtype (default: auto for PyTorch, fp16 for ONNX)")
    p.add_argument("--format", default="table", choices=FORMATS, help="output format")
    p.add_argument("--output", "-o", metavar="FILE", help="write the report to FILE")
    p.add_argument("--diff", type=_arg(parse_level), metavar="LEVEL",
                   help="also show what changes at LEVEL")
    p.add_argument("--train", action="store_true", help="capture in train mode (default eval)")
    _add_inputs(p)
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", parents=[common], help="convert an fp32 ONNX model to "
                       "mixed precision", description="The ONNX pass: convert an fp32 "
                       "ONNX model to mixed precision at a level.")
    p.add_argument("input", metavar="IN.onnx")
    p.add_argument("output", metavar="OUT.onnx")
    _add_onnx_output(p, level)
    p.add_argument("--block-op", action="append", default=[], metavar="OP",
                   help="ONNX op type kept in fp32, e.g. Softmax (repeatable)")
    p.add_argument("--block-node", action="append", default=[], metavar="NAME",
                   help="node name or fnmatch pattern kept in fp32 (repeatable)")
    p.add_argument("--validate", action="store_true", help="run both models on random "
                   "inputs and print the errors (exit 1 when out of tolerance)")
    p.add_argument("--rtol", type=float, default=1e-2, help="validation rtol (default 1e-2)")
    p.add_argument("--atol", type=float, default=1e-3, help="validation atol (default 1e-3)")
    p.add_argument("--input-shape", action="append", default=[], metavar="SHAPE",
                   type=_arg(parse_shape), help="validation input shape (per input; "
                   "default: declared shape, 1 for symbolic dimensions)")
    p.add_argument("--int-high", type=int, default=2, metavar="N",
                   help="integer validation inputs are drawn from [0, N)")
    p.set_defaults(func=cmd_convert)

    p = sub.add_parser("export", parents=[common], help="export a PyTorch model to a "
                       "mixed-precision ONNX file", description="torch.onnx export of the "
                       "fp32 model followed by the ONNX pass.")
    p.add_argument("target", metavar="TARGET")
    p.add_argument("output", metavar="OUT.onnx")
    _add_onnx_output(p, level)
    p.add_argument("--opset", type=int, default=None, help="ONNX opset (default: exporter's)")
    _add_inputs(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("bench", parents=[common], help="time fp32, torch.autocast and "
                       "ampgraph levels", description="Median/min/max step time and peak "
                       "memory of fp32 eager, torch.autocast and ampgraph at each level, "
                       "measured interleaved in one process.")
    p.add_argument("target", metavar="TARGET")
    p.add_argument("--levels", type=_arg(parse_levels), default=["O0", "O1", "O2"],
                   metavar="LEVELS", help="comma-separated levels (default O0,O1,O2)")
    p.add_argument("--dtype", default="auto", choices=("auto", "bf16", "fp16"),
                   help="low dtype (default auto: bf16 on CPU and sm_80+)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per variant (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--train", action="store_true", help="forward + backward + SGD step")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="default: cuda when available")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    _add_inputs(p)
    p.set_defaults(func=cmd_bench)
    p = sub.add_parser("monitor-report", add_help=False,
                       help="summarise a NumericsMonitor log directory (and --plot a PNG)")
    p.add_argument("args", nargs=argparse.REMAINDER)
    return parser


# ------------------------------------------------------------------------------ main


def _warning(message: Any, category: Any, filename: str, lineno: int, line: Any = None) -> str:
    text = str(message).strip().splitlines()[0] if str(message).strip() else category.__name__
    return f"ampgraph: warning: {text.removeprefix('ampgraph: ')}\n"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ampgraph`` command; return its exit code.

    Example:
        >>> main(["inspect", "models/lenet5.py:make_model", "--format", "json"])
        0
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["monitor-report"]:  # its own argparse (ampgraph.monitor.report_main)
        from ampgraph.monitor import report_main

        return report_main(argv[1:])
    args = build_parser().parse_args(argv)
    debug = bool(getattr(args, "debug", False))
    saved_format = warnings.formatwarning  # catch_warnings does not restore this one
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (DeprecationWarning, FutureWarning))
        if not debug:
            warnings.formatwarning = _warning  # type: ignore[assignment]
        try:
            return int(args.func(args) or 0)
        except CliError as exc:
            if debug:
                traceback.print_exc()
            print(f"ampgraph {args.command}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print(f"ampgraph {args.command}: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:
            if debug:
                traceback.print_exc()
            print(f"ampgraph {args.command}: error: {one_line(exc)} (rerun with --debug for "
                  "the traceback)", file=sys.stderr)
            return 1
        finally:
            warnings.formatwarning = saved_format


# ------------------------------------------------------------------------------ commands


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
    from ampgraph._cli_inspect import inspect_target
    from ampgraph._cli_render import diff, to_dot, to_json, to_table, use_color

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
        from ampgraph._cli_html import to_html

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
    from ampgraph._cli_onnx import load, random_feeds
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
    from ampgraph._cli_render import human_bytes
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
    from ampgraph._cli_onnx import load
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
    print(f"wrote {args.output} ({args.level} {dtype}): {len(out.graph.node)} nodes, "
          f"{casts} Cast nodes, inputs {ins}, {Path(args.output).stat().st_size} bytes")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """``ampgraph bench``: step times and peak memory per variant."""
    import json

    import torch

    from ampgraph import _cli_bench
    from ampgraph.config import dtype_name, resolve_dtype

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
    low = resolve_dtype(args.dtype, device)
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


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
