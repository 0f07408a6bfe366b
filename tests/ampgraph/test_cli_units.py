"""In-process tests of the CLI's pieces: argument parsing and errors, target loading,
inputs, rendering (table colours, DOT, HTML layout), statistics and the memory tracker."""

from __future__ import annotations

import json

import pytest
import torch

from ampgraph import _cli_bench
from ampgraph._analysis import GraphView, ViewNode
from ampgraph._cli_html import layout, to_html
from ampgraph._cli_render import Inspection, diff, to_dot, to_table, use_color
from ampgraph._cli_target import (
    CliError,
    build_model,
    make_inputs,
    parse_levels,
    parse_shape,
    parse_target,
)
from ampgraph.cli import build_parser, main

# ------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize("text, shape", [("2,3,32,32", (2, 3, 32, 32)), (" 8 , 16 ", (8, 16)),
                                         ("4x64", (4, 64)), ("", ())])
def test_parse_shape(text, shape):
    assert parse_shape(text) == shape


@pytest.mark.parametrize("text", ["2,a", "2,,3", "-1,3", "0,3", "2.5", "[2,3]"])
def test_parse_shape_rejects(text):
    with pytest.raises(CliError, match="e.g. --input-shape 2,3,32,32"):
        parse_shape(text)


def test_parse_target_forms(tmp_path):
    assert parse_target("models/lenet5.py:make_model").function == "make_model"
    assert parse_target("models/lenet5.py").function == "make_model"
    t = parse_target("torchvision.models:resnet18")
    assert (t.kind, t.source, t.function) == ("factory", "torchvision.models", "resnet18")
    (tmp_path / "m.onnx").write_bytes(b"")
    assert parse_target(str(tmp_path / "m.onnx")).kind == "onnx"


@pytest.mark.parametrize("spec, message", [
    ("resnet", "bad target 'resnet'"),
    ("models/lenet5.py:make-model", "is not a Python function name"),
    ("models/missing.py:f", "models/missing.py: no such file"),
    ("missing.onnx", "missing.onnx: no such ONNX file"),
    ("a/b.txt:f", "neither a .py file nor a module"),
])
def test_parse_target_errors(spec, message):
    with pytest.raises(CliError, match=message):
        parse_target(spec)


def test_parse_levels():
    assert parse_levels("o0, O2") == ["O0", "O2"]
    with pytest.raises(CliError, match="unknown level 'O5'"):
        parse_levels("O1,O5")


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


# ------------------------------------------------------------------------------ targets


def test_build_model_and_example_inputs():
    model, module = build_model(parse_target("models/bert_encoder.py:make_model"))
    inputs = make_inputs(module, [], [])
    assert [t.dtype for t in inputs] == [torch.int64, torch.int64]
    assert model(*inputs).shape == (2, 2)


def test_make_inputs_from_shapes():
    ids, mask = make_inputs(None, [(2, 16), (2, 16)], ["int64"])
    assert ids.dtype == mask.dtype == torch.int64 and ids.shape == (2, 16)
    assert int(ids.min()) >= 0 and int(ids.max()) <= 1
    x, flags = make_inputs(None, [(3, 4), (3,)], ["bfloat16", "bool"])
    assert x.dtype == torch.bfloat16 and flags.dtype == torch.bool
    with pytest.raises(CliError, match="2 --input-dtype for 3 --input-shape"):
        make_inputs(None, [(1,), (1,), (1,)], ["int64", "float32"])
    with pytest.raises(CliError, match="has no example_inputs"):
        make_inputs(None, [], [])


# ------------------------------------------------------------------------------ rendering


def _inspection(level: str = "O2", softmax: str = "bf16") -> Inspection:
    nodes = [
        {"name": "x", "op": "placeholder", "module": "", "precision": "fp32",
         "reason": "graph input"},
        {"name": "mm", "op": "aten.mm", "module": "fc", "precision": "bf16", "reason": "allow"},
        {"name": 'soft"max<b>', "op": "aten.softmax", "module": "head", "precision": softmax,
         "reason": "deny & <why>"},
    ]
    view = GraphView(
        [ViewNode("x", "x", "placeholder", "fp32", "input"),
         ViewNode("c", "cast to bf16", "cast", "cast", "cast", "", "from x"),
         ViewNode("w", "cast to bf16", "cast", "cast", "cast", "", "fc.weight"),
         ViewNode("mm", "mm", "aten.mm", "bf16", "op", "fc"),
         ViewNode('soft"max<b>', 'soft"max<b>', "aten.softmax", softmax, "op", "head"),
         ViewNode("output", "output", "output", "n/a", "output")],
        [("x", "c"), ("c", "mm"), ("w", "mm"), ("mm", 'soft"max<b>'),
         ('soft"max<b>', "output")])
    summary = {"nodes": 3, "by_precision": {"bf16": 1, "fp32": 2}, "casts": 2,
               "matmul_conv_flops": 2048, "matmul_conv_flops_low": 2048, "low_flops_share": 1.0,
               "param_bytes_fp32": 400, "param_bytes_low": 200, "param_bytes_runtime": 600,
               "param_bytes_baseline": 400, "activation_bytes": 100,
               "activation_bytes_fp32": 160, "activation_saving": 0.375,
               "activation_peak_bytes": 50, "activation_peak_bytes_fp32": 80,
               "activation_peak_saving": 0.375, "input_shapes": [[2, 8]], "eager_modules": []}
    return Inspection("t.py:f", "torch", level, "bf16", nodes, 2, summary, view)


def test_table_colours_only_when_asked(monkeypatch):
    insp = _inspection()
    plain = to_table(insp, color=False)
    assert "\x1b[" not in plain and "deny & <why>" in plain
    coloured = to_table(insp, color=True, width=200)
    assert "\x1b[32mbf16" in coloured and "\x1b[34mfp32" in coloured

    class Tty:
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert use_color(Tty())
    monkeypatch.setenv("NO_COLOR", "1")
    assert not use_color(Tty())


def test_diff_and_json_schema():
    base, other = _inspection(), _inspection("O1", softmax="fp32")
    base.diff = diff(base, other)
    doc = json.loads(json.dumps(base.to_dict()))
    assert list(doc) == ["schema", "target", "kind", "level", "dtype", "nodes", "casts",
                         "summary", "diff"]
    assert doc["diff"]["changed"] == [{"name": 'soft"max<b>', "op": "aten.softmax",
                                       "module": "head", "from": "bf16", "to": "fp32",
                                       "reason": "deny & <why>"}]
    assert "O2 -> O1: 1 node(s) change precision" in to_table(base)


def test_dot_escapes_and_draws_casts():
    base = _inspection()
    base.diff = diff(base, _inspection("O1", softmax="fp32"))
    dot = to_dot(base)
    assert '"soft\\"max<b>" [label="soft\\"max<b>\\naten.softmax\\nbf16\\nO1: fp32"' in dot
    assert dot.count('shape="diamond"') == 2 and '"c" -> "mm";' in dot
    assert 'penwidth="3"' in dot


def test_html_escapes_everything():
    page = to_html(_inspection())
    assert "soft&quot;max&lt;b&gt;" in page and "<b>" not in page.replace("<body>", "")
    assert "deny &amp; &lt;why&gt;" in page


def test_layout_layers():
    pos, width, height = layout(_inspection().view)
    y = {k: v[1] for k, v in pos.items()}
    assert y["x"] < y["c"] < y["mm"] < y['soft"max<b>'] < y["output"]
    assert y["w"] == y["c"]  # a weight cast sits right above its consumer
    assert width > 0 and height > y["output"]


# ------------------------------------------------------------------------------ bench pieces


def test_storage_peak_tracks_new_storage_only():
    base = torch.zeros(1000)
    with _cli_bench._StoragePeak() as tracker:
        a = base + 1  # 4000 bytes
        a.add_(1)  # in place: nothing new
        v = a.view(10, 100)  # a view: nothing new
        b = v * 2  # 4000 more
        del a, v, b
        c = torch.ones(250)  # reuses the freed budget: peak stays 8000
    assert tracker.peak == 8000 and c.numel() == 250


def test_bench_table_reports_failed_variant():
    records = [{"name": "fp32", "median_ms": 2.0, "min_ms": 1.0, "max_ms": 3.0, "speedup": 1.0,
                "peak_bytes": 2048},
               {"name": "ampgraph O2", "error": "RuntimeError: boom"}]
    text = _cli_bench.table(records)
    assert "1.00x" in text and "2.0 KiB" in text and "failed: RuntimeError: boom" in text
