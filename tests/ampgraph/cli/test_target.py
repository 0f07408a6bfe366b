"""ampgraph.cli.target: TARGET, --input-shape and --level parsing, models and inputs."""

from __future__ import annotations

import pytest
import torch

from ampgraph.cli.target import (
    CliError,
    build_model,
    make_inputs,
    parse_levels,
    parse_shape,
    parse_target,
)

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
