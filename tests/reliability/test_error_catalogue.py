"""The bad-input catalogue of docs/errors.md: one test per entry (the test names are cited there).

Each test checks the message says what was wrong and how to fix it, and, where a file could
be written, that nothing (not even a temporary file) is left on disk and that a file already
at the output path is untouched. Entries with a known gap are strict xfails (see the report
in docs/errors.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import ampgraph
from ampgraph.onnx import OnnxModelError, convert_onnx

REPO = Path(__file__).resolve().parents[2]


def linear() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 4)


# -- ampgraph.compile -------------------------------------------------------------------


@pytest.mark.parametrize("level", ["O4", "", "fast", None, 2])
def test_e01_wrong_level(level):
    with pytest.raises(ValueError, match=r"unknown amp_level .*: choose one of O0, O1, O2, O3"):
        ampgraph.compile(linear(), amp_level=level)


@pytest.mark.parametrize("dtype", ["fp8", "float32", torch.float32, torch.int8, 16])
def test_e02_wrong_dtype(dtype):
    with pytest.raises(ValueError, match=r"unknown dtype .*: choose one of auto, bf16, fp16, "
                                         r"torch.bfloat16, torch.float16"):
        ampgraph.compile(linear(), dtype=dtype)


@pytest.mark.parametrize("obj", [lambda x: x, "model.pt", None, torch.zeros(2)])
def test_e03_not_a_module(obj):
    with pytest.raises(TypeError, match=r"expects a torch.nn.Module, got \w+; wrap a function "
                                        r"in an nn.Module first"):
        ampgraph.compile(obj)


def test_e04_model_on_the_meta_device():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"on the meta device \(0.weight has no data\): "
                                         r"materialise it first, e.g. model.to_empty"):
        ampgraph.compile(model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_e05_model_already_in_half_precision(dtype):
    with pytest.raises(ValueError, match=r"parameter weight is already torch.(b?float16): "
                                         r".*call model.float\(\) first"):
        ampgraph.compile(linear().to(dtype))


def test_e06_compiling_twice():
    model = linear()
    net = ampgraph.compile(model, "O2", "bf16")
    assert ampgraph.compile(net, "O2", "bf16") is net  # same options: a no-op
    assert ampgraph.compile(net, "o2", "bf16") is net
    for level, dtype in (("O1", "bf16"), ("O3", "bf16"), ("O2", "fp16")):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # fp16 on a CPU
            with pytest.raises(ValueError, match=r"already compiled at O2 \(torch.bfloat16\); "
                                                 r"compile the original module "
                                                 r"\(net.original_module\)"):
                ampgraph.compile(net, level, dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"compiled at amp_level='O2' but build_train_step got "
                                         r"amp_level='O1': drop the argument or pass 'O2'"):
        ampgraph.build_train_step(net, F.mse_loss, opt, "O1")
    x = torch.randn(2, 4)
    net(x)
    casts = net._amp_last.casts
    ampgraph.compile(net, "O2", "bf16")(x)
    assert net._amp_last.casts == casts, "no double casts"


@pytest.mark.parametrize("dtype", [torch.bfloat16, "bfloat16", "auto"])
def test_e06_compiling_twice_with_the_same_dtype_spelled_differently(dtype):
    net = ampgraph.compile(linear(), "O2", "bf16")
    assert ampgraph.compile(net, "O2", dtype) is net


class IntsOnly(nn.Module):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ids * 2 + 1


def test_e07_model_with_no_float_ops():
    net = ampgraph.compile(IntsOnly(), "O2", "bf16")
    with pytest.warns(UserWarning, match=r"IntsOnly has no floating-point ops; compiling it "
                                         r"changes nothing"):
        out = net(torch.arange(4))
    assert torch.equal(out, torch.arange(4) * 2 + 1)


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum().item() > -1e9:  # data-dependent Python control flow
            h = self.b(h)
        return h


def test_e08_untraceable_parts_fall_back_per_submodule():
    model = Untraceable()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"Untraceable could not be captured whole \(torch.export "
                                         r"failed: .*\); its own code runs eagerly in fp32 and "
                                         r"each submodule is compiled separately. "
                                         r"ampgraph.explain\(model\) lists what stayed eager."):
        out = net(x)
    torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)
    text = str(ampgraph.explain(net, x))
    assert "EAGER (fp32) <root> [Untraceable]" in text and "bf16" in text


def test_e09_cli_without_example_inputs(tmp_path):
    factory = tmp_path / "factory.py"
    factory.write_text("from torch import nn\n\ndef make_model():\n    return nn.Linear(4, 4)\n")
    report = tmp_path / "report.txt"
    r = subprocess.run([sys.executable, "-m", "ampgraph", "inspect", f"{factory}:make_model",
                        "-o", str(report)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == (f"ampgraph inspect: error: no --input-shape given and {factory} "
                                "has no example_inputs(); pass e.g. --input-shape 2,3,32,32")
    assert r.stdout == "" and not report.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["factory.py"]


# -- ampgraph.onnx.convert_onnx ---------------------------------------------------------


def vi(name: str, dtype: int = TensorProto.FLOAT, shape=(2, 4)):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def onnx_model(nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10
    return model


def matmul_softmax(opset: int = 17, size: int = 4) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.eye(size, dtype=np.float32), "w")
    return onnx_model([helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
                       helper.make_node("Softmax", ["h"], ["y"], name="sm")],
                      [vi("x", shape=(2, size))], [vi("y", shape=(2, size))], [w], opset)


class Disk:
    """The output directory: nothing new in it, and an existing output file untouched."""

    def __init__(self, tmp_path: Path) -> None:
        self.dir = tmp_path / "out"
        self.dir.mkdir()
        self.existing = self.dir / "kept.onnx"
        self.existing.write_bytes(b"previous result")
        self.fresh = self.dir / "new.onnx"

    def unchanged(self) -> bool:
        return (sorted(p.name for p in self.dir.iterdir()) == ["kept.onnx"]
                and self.existing.read_bytes() == b"previous result")


def convert_both(model, disk: Disk, **kwargs) -> list[BaseException]:
    """Convert to a fresh and to an existing output path; return the two errors raised."""
    errors = []
    for path in (disk.fresh, disk.existing):
        try:
            convert_onnx(model, output_path=path, **kwargs)
        except Exception as exc:
            errors.append(exc)
    return errors


@pytest.mark.parametrize("kwargs, message", [
    (dict(amp_level="O4"), r"unknown amp_level 'O4': choose one of O0, O1, O2, O3"),
    (dict(dtype="fp8"), r"unknown dtype 'fp8' for ONNX: choose 'fp16' or 'bf16'"),
    (dict(dtype="auto"), r"unknown dtype 'auto' for ONNX: choose 'fp16' or 'bf16'"),
])
def test_e10_onnx_wrong_level_or_dtype(tmp_path, kwargs, message):
    disk = Disk(tmp_path)
    errors = convert_both(matmul_softmax(), disk, **kwargs)
    assert len(errors) == 2 and all(isinstance(e, ValueError) for e in errors)
    assert all(re.search(message, str(e)) for e in errors)
    assert disk.unchanged()


def test_e10_onnx_level_is_case_insensitive_like_compile():
    assert convert_onnx(matmul_softmax(), "o2") is not None


def _corrupt(tmp_path: Path) -> list[Path]:
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x08\x07garbage\xff\xff" * 10)
    data = matmul_softmax().SerializeToString()
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(data[: len(data) // 2])
    return [garbage, truncated]


def test_e11_onnx_corrupt_file(tmp_path):
    disk = Disk(tmp_path)
    for path in _corrupt(tmp_path):
        errors = convert_both(path, disk)
        assert len(errors) == 2 and all(isinstance(e, OnnxModelError) for e in errors)
        assert all(f"{path} is not a readable ONNX model (" in str(e) and
                   str(e).endswith("nothing was written") for e in errors)
    errors = convert_both(b"not a model", disk)
    assert all(isinstance(e, OnnxModelError) for e in errors) and len(errors) == 2
    assert disk.unchanged()


def test_e11_onnx_corrupt_file_message_says_how_to_fix(tmp_path):
    with pytest.raises(OnnxModelError) as info:
        convert_onnx(_corrupt(tmp_path)[0])
    assert any(w in str(info.value) for w in ("re-export", "export it again", "download"))


def test_e12_onnx_missing_external_data(tmp_path):
    disk = Disk(tmp_path)
    path = tmp_path / "external.onnx"
    onnx.save_model(matmul_softmax(size=64), str(path), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="external.onnx.data", size_threshold=0)
    (tmp_path / "external.onnx.data").unlink()
    errors = convert_both(path, disk)
    assert len(errors) == 2 and all(isinstance(e, OnnxModelError) for e in errors)
    for e in errors:
        assert f"{path} is not a readable ONNX model" in str(e)
        assert f"should be stored in {tmp_path / 'external.onnx.data'}" in str(e)
        assert str(e).endswith("nothing was written")
    assert disk.unchanged()


def _no_float_model() -> onnx.ModelProto:
    return onnx_model([helper.make_node("Add", ["a", "b"], ["c"], name="add")],
                      [vi("a", TensorProto.INT64), vi("b", TensorProto.INT64)],
                      [vi("c", TensorProto.INT64)])


def _message(fn) -> str:
    """The error message, or the warnings' text when it does not raise."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
        except (ValueError, TypeError) as exc:
            return str(exc)
    return " | ".join(str(w.message) for w in caught)


def test_e13_onnx_model_with_no_float_tensors():
    assert "float" in _message(lambda: convert_onnx(_no_float_model(), "O2"))


def test_e13_onnx_model_with_no_float_tensors_is_left_unchanged(tmp_path):
    """What it does today: the written model computes the same thing (no Cast added)."""
    out = convert_onnx(_no_float_model(), "O2", output_path=tmp_path / "ints.onnx")
    assert [n.op_type for n in out.graph.node] == ["Add"]


def test_e14_onnx_opset_too_old_for_fp16_casts(tmp_path):
    disk = Disk(tmp_path)
    errors = convert_both(matmul_softmax(opset=5), disk)
    assert disk.unchanged()  # holds today: nothing is written
    assert len(errors) == 2 and all(isinstance(e, ValueError) for e in errors)
    assert all("opset" in str(e) and "version_converter" in str(e) for e in errors)


def test_e14_onnx_old_opset_writes_nothing(tmp_path):
    """What holds today for opset <= 5: an error (PassError) and nothing on disk."""
    disk = Disk(tmp_path)
    errors = convert_both(matmul_softmax(opset=5), disk)
    assert len(errors) == 2 and disk.unchanged()


def test_e14_onnx_opset_too_old_for_bf16():
    assert "opset" in _message(lambda: convert_onnx(matmul_softmax(opset=11), "O2", "bf16"))


def test_e15_cli_convert_corrupt_file(tmp_path):
    """The CLI path of e11: one line on stderr, exit code 2, no output file."""
    garbage = _corrupt(tmp_path)[0]
    out = tmp_path / "out.onnx"
    r = subprocess.run([sys.executable, "-m", "ampgraph", "convert", str(garbage), str(out)],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "is not a readable ONNX model" in r.stderr and not out.exists()


def test_e16_onnx_converting_twice(tmp_path):
    """Same options: the converted model comes back as it is. Others: ValueError, no file."""
    once = convert_onnx(matmul_softmax(), "O1", "fp16")
    assert convert_onnx(once, "O1", "fp16") is once
    disk = Disk(tmp_path)
    for level, dtype in (("O2", "fp16"), ("O1", "bf16")):
        errors = convert_both(once, disk, amp_level=level, dtype=dtype)
        assert len(errors) == 2 and all(isinstance(e, ValueError) for e in errors)
        assert all(str(e) == "this model was already converted by ampgraph at O1 fp16; convert "
                   "the original FP32 model instead" for e in errors)
    assert disk.unchanged()


def test_cli_main_in_process_leaves_warning_formatting_alone(capsys):
    from ampgraph.cli import main

    before = warnings.formatwarning
    try:
        assert main(["inspect", "/no/such/factory.py:make_model"]) == 2
    finally:
        replaced, warnings.formatwarning = warnings.formatwarning, before
    assert "no such file" in capsys.readouterr().err
    assert replaced is before
