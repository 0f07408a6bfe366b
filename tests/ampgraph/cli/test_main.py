"""ampgraph.cli.main: the argument parser, its help, defaults and one-line errors."""

from __future__ import annotations

import pytest

from ampgraph.cli import build_parser, main

# ------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize("command", ["inspect", "convert", "export", "bench"])
def test_help_of_each_subcommand(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: ampgraph {command}") and "--debug" in out


@pytest.mark.parametrize("argv, message", [
    (["inspect", "models/lenet5.py:make_model", "--input-shape", "2,x"], "bad --input-shape"),
    (["inspect", "models/lenet5.py:make_model", "--level", "O7"], "unknown level 'O7'"),
    (["bench", "models/lenet5.py:make_model", "--levels", "O1,O9"], "unknown level 'O9'"),
    (["inspect", "models/lenet5.py:make_model", "--format", "svg"], "invalid choice: 'svg'"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    (["inspect"], "required: TARGET"),
])
def test_argument_errors_are_one_line_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err and "--help" in err


@pytest.mark.parametrize("argv, message", [
    (["inspect", "models/lenet5.py:nope"], "has no function 'nope' (it defines: "),
    (["inspect", "no_such_package.sub:make"], "no module named 'no_such_package.sub'"),
    (["inspect", "models/lenet5.py:make_model", "--input-shape", "2,5"],
     "the model fails on inputs (2x5)"),
    (["inspect", "models/lenet5.py:make_model", "--input-dtype", "int64"],
     "--input-dtype needs --input-shape"),
    (["bench", "models/lenet5.py:make_model", "--steps", "0"], "--steps must be >= 1"),
    (["export", "models/lenet5.py:make_model", "out.txt"], "must be an .onnx file"),
    (["convert", "models/lenet5.py:make_model", "out.onnx"], "convert takes an .onnx file"),
])
def test_user_errors_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_defaults():
    args = build_parser().parse_args(["bench", "models/lenet5.py:make_model"])
    assert (args.levels, args.steps, args.dtype, args.train) == (["O0", "O1", "O2"], 20,
                                                                  "auto", False)
    args = build_parser().parse_args(["convert", "a.onnx", "b.onnx", "--no-keep-io-types",
                                      "--block-op", "Softmax", "--block-op", "Exp"])
    assert args.keep_io_types is False and args.block_op == ["Softmax", "Exp"]
