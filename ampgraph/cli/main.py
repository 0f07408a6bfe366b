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
from typing import Any

from ampgraph.cli.commands import (
    cmd_bench,
    cmd_convert,
    cmd_export,
    cmd_inspect,
    cmd_monitor_report,
)
from ampgraph.cli.target import (
    CliError,
    one_line,
    parse_dtype,
    parse_level,
    parse_levels,
    parse_shape,
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
    p.add_argument("--fp8", choices=("tensorwise", "rowwise"), default=None,
                   help="PyTorch targets: the products that pay run in FP8 with this scaling "
                        "(ampgraph.FP8Recipe); the report says why each does or does not")
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

    p = sub.add_parser("monitor-report", parents=[common], help="summarise a NumericsMonitor "
                       "log directory (and --plot a PNG)", description="Summarise a "
                       "NumericsMonitor log directory (numerics.jsonl).")
    p.add_argument("log_dir", metavar="LOG_DIR", help="the monitor's log_dir")
    p.add_argument("--plot", metavar="PATH", help="also write a PNG of the underflow rate per "
                   "layer and the loss scale (needs matplotlib)")
    p.add_argument("--top", type=int, default=20, metavar="N",
                   help="layers shown per table (default 20)")
    p.set_defaults(func=cmd_monitor_report)
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


def report_main(argv: Sequence[str]) -> int:
    """``ampgraph monitor-report LOG_DIR [--plot PATH] [--top N]`` in process.

    Returns the exit code: 0, or 2 with one line on stderr for bad arguments (argparse's
    exit included), a missing or empty log directory, an unreadable log, or ``--plot``
    without matplotlib.

    Example:
        >>> report_main(["runs/numerics", "--plot", "numerics.png"])  # doctest: +SKIP
        0
    """
    try:
        return main(["monitor-report", *argv])
    except SystemExit as exc:  # argparse already printed usage and the error (or --help)
        return int(exc.code or 0)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
