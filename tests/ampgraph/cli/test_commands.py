"""End-to-end tests of the ``ampgraph`` command: every subcommand runs as a subprocess
(``python -m ampgraph ...``) on reference models and hand-built ONNX files.

The commands are independent, so a module fixture starts them all at once on a small
thread pool and each test waits for the run it checks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

REPO = Path(__file__).resolve().parents[3]
ROW_KEYS = {"name", "op", "module", "precision", "reason"}
VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source",
        "track", "wbr"}


def hand_mlp(path: Path) -> Path:
    """x (batch, 16) -> MatMul -> Add -> Relu -> MatMul -> Softmax, built by hand."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((0.2 * rng.standard_normal((16, 32))).astype(np.float32),
                                     "W1"),
             numpy_helper.from_array(np.zeros(32, np.float32), "b1"),
             numpy_helper.from_array((0.2 * rng.standard_normal((32, 8))).astype(np.float32),
                                     "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
             helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
             helper.make_node("Relu", ["hb"], ["r"], name="act"),
             helper.make_node("MatMul", ["r", "W2"], ["logits"], name="fc2"),
             helper.make_node("Softmax", ["logits"], ["probs"], name="softmax", axis=-1)]
    graph = helper.make_graph(
        nodes, "hand_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def cli(*args: object, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ampgraph", *map(str, args)], cwd=REPO,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    hand_mlp(d / "mlp.onnx")
    (d / "garbage.onnx").write_bytes(b"this is not an ONNX model")
    (d / "bad_factory.py").write_text(
        "def make_model():\n    raise RuntimeError('checkpoint weights.pt not found')\n")
    return d


@pytest.fixture(scope="module")
def runs(tmp) -> dict[str, Future]:
    lenet, mlp = "models/lenet5.py:make_model", "models/tabular_mlp.py:make_model"
    commands = {  # the slowest first: the pool's tail stays short
        "export": ("export", lenet, tmp / "lenet_o2.onnx", "--level", "O2", "--dtype", "fp16"),
        "bench": ("bench", mlp, "--steps", "2", "--warmup", "1", "--levels", "O1,O2", "--train",
                  "--json"),
        "inspect_json": ("inspect", lenet, "--format", "json", "--diff", "O1"),
        "inspect_html": ("inspect", mlp, "--format", "html", "--diff", "O1", "-o",
                         tmp / "mlp.html"),
        "inspect_dot": ("inspect", lenet, "--format", "dot"),
        "inspect_table": ("inspect", mlp, "--level", "O1", "--dtype", "bf16", "--train",
                          "--input-shape", "4,64"),
        "convert": ("convert", tmp / "mlp.onnx", tmp / "mlp_fp16.onnx", "--validate",
                    "--block-op", "Relu"),
        "convert_noio": ("convert", tmp / "mlp.onnx", tmp / "mlp_o3.onnx", "--level", "O3",
                         "--no-keep-io-types", "--block-node", "fc2", "--validate",
                         "--input-shape", "3,16"),
        "onnx_inspect": ("inspect", tmp / "mlp.onnx", "--format", "json", "--input-shape",
                         "4,16", "--diff", "O3"),
        "err_missing": ("inspect", "models/no_such_model.py:make_model"),
        "err_build": ("inspect", tmp / "bad_factory.py:make_model"),
        "err_build_debug": ("inspect", tmp / "bad_factory.py:make_model", "--debug"),
        "err_onnx": ("convert", tmp / "garbage.onnx", tmp / "out.onnx"),
    }
    pool = ThreadPoolExecutor(max_workers=3)
    futures = {k: pool.submit(cli, *v) for k, v in commands.items()}
    futures["lean_import"] = pool.submit(
        subprocess.run, [sys.executable, "-c", "import sys, ampgraph; print(sorted(m for m in "
                         "sys.modules if m.startswith(('ampgraph.cli', 'ampgraph._cli', "
                         "'ampgraph.cli.analysis', 'ampgraph.onnx', 'onnx'))))"],
        cwd=REPO, capture_output=True, text=True, timeout=120)
    yield futures
    pool.shutdown(wait=True)


def ok(runs: dict, key: str) -> subprocess.CompletedProcess:
    r = runs[key].result()
    assert r.returncode == 0, f"{key}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r


def failed(runs: dict, key: str) -> str:
    r = runs[key].result()
    assert r.returncode == 2, f"{key}: rc={r.returncode}\n{r.stdout}\n{r.stderr}"
    return r.stderr


# ------------------------------------------------------------------------------ inspect


def test_inspect_json_schema_and_numbers(runs):
    doc = json.loads(ok(runs, "inspect_json").stdout)
    assert doc["schema"] == "ampgraph.inspect/1"
    assert (doc["target"], doc["kind"], doc["level"]) == ("models/lenet5.py:make_model", "torch",
                                                          "O2")
    assert doc["dtype"] in ("bf16", "fp16")
    assert doc["nodes"] and all(set(n) == ROW_KEYS for n in doc["nodes"])
    convs = [n for n in doc["nodes"] if n["op"] == "aten.conv2d"]
    assert [n["module"] for n in convs] == ["features.0", "features.3"]
    assert all(n["precision"] == doc["dtype"] and n["reason"] for n in convs)
    s = doc["summary"]
    assert s["casts"] == doc["casts"] > 0
    assert s["nodes"] == len(doc["nodes"]) == sum(s["by_precision"].values())
    # conv1 2x6x28x28 x (1*25) + conv2 2x16x10x10 x (6*25) + linears 400->120->84->10, x2
    assert s["matmul_conv_flops"] == 2 * (9408 * 25 + 3200 * 150 + 2 * (400 * 120 + 120 * 84
                                                                         + 84 * 10))
    assert s["matmul_conv_flops_low"] == s["matmul_conv_flops"] and s["low_flops_share"] == 1
    params = 4 * (6 * 25 + 6 + 16 * 150 + 16 + 400 * 120 + 120 + 120 * 84 + 84 + 84 * 10 + 10)
    assert s["param_bytes_fp32"] == s["param_bytes_baseline"] == params
    assert s["param_bytes_low"] == params // 2
    assert s["param_bytes_runtime"] == params + params // 2
    assert s["activation_bytes"] < s["activation_bytes_fp32"]
    assert 0.3 < s["activation_saving"] < 0.6 and 0.3 < s["activation_peak_saving"] <= 0.5
    assert s["input_shapes"] == [[2, 1, 32, 32]] and s["eager_modules"] == []
    diff = doc["diff"]
    assert diff["level"] == "O1" and set(diff) >= {"changed", "summary"}
    assert diff["summary"]["casts"][0] == doc["casts"]


def test_inspect_table(runs):
    out = ok(runs, "inspect_table").stdout
    assert "\x1b[" not in out  # not a terminal: no colour
    lines = out.splitlines()
    assert lines[0] == "ampgraph inspect models/tabular_mlp.py:make_model: O1 bf16 (train mode)"
    assert lines[2].split() == ["name", "op", "module", "precision", "reason"]
    linear = next(line for line in lines if line.startswith("linear "))
    assert linear.split()[:4] == ["linear", "aten.linear", "blocks.0.linear", "bf16"]
    norm = next(line for line in lines if line.startswith("batch_norm "))
    assert norm.split()[3] == "fp32" and "deny list" in norm
    summary = {line.split("  ")[1]: line for line in lines if line.startswith("  ")}
    assert set(summary) >= {"ops", "casts inserted", "matmul/conv FLOPs", "parameters",
                            "activations", "inputs", "eager (fp32)"}
    # 4 x (64*128 + 2*128*128 + 128*10) multiply-adds
    assert "337.92 KFLOP: bf16 100.0%, fp8 0.0%, fp32 0.0%" in summary["matmul/conv FLOPs"]
    # computations and parameters counted apart: 4 linears, 3 batch norms, ...
    assert re.search(r"ops +\d+ \(bf16 \d+, fp32 \d+.*\); parameters and buffers \d+, "
                     "counted apart", summary["ops"])
    assert summary["inputs"].endswith("4x64")


def test_inspect_dot(runs):
    out = ok(runs, "inspect_dot").stdout
    assert out.startswith("digraph ampgraph {") and out.rstrip().endswith("}")
    assert out.count("{") == out.count("}")
    assert 'shape="diamond"' in out  # casts are their own nodes
    assert '"conv2d" [label="conv2d\\naten.conv2d\\nbf16", fillcolor="#8fd18f"' in out
    nodes = [line for line in out.splitlines() if " [label=" in line and "legend:" not in line]
    edges = [line for line in out.splitlines() if " -> " in line]
    assert len(edges) >= len(nodes) - 1
    casts = [line.split()[0] for line in nodes if 'shape="diamond"' in line]
    assert len(casts) == json.loads(ok(runs, "inspect_json").stdout)["casts"]
    assert any(e.startswith(f"  {c} -> ") for c in casts for e in edges)
    assert "cluster_legend" in out


class _Checker(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []
        self.tags: Counter = Counter()
        self.attrs: list[tuple[str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        self.tags[tag] += 1
        self.attrs += attrs
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.tags[tag] += 1
        self.attrs += attrs

    def handle_endtag(self, tag):
        if tag in VOID:
            return
        if not self.stack or self.stack[-1] != tag:
            self.errors.append(f"</{tag}> closes {self.stack[-1:]} at {self.getpos()}")
        else:
            self.stack.pop()


def test_inspect_html_is_well_formed_and_self_contained(runs, tmp):
    r = ok(runs, "inspect_html")
    assert "wrote" in r.stdout
    page = (tmp / "mlp.html").read_text(encoding="utf-8")
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert not checker.errors and not checker.stack, (checker.errors, checker.stack)
    assert page.startswith("<!DOCTYPE html>")
    assert checker.tags["script"] == 2  # the data (JSON) and the code that draws it
    # the only URL is the SVG namespace the script creates its drawings in (not a request)
    assert set(re.findall(r"https?://[^'\"\s]*", page)) == {"http://www.w3.org/2000/svg"}
    for name, value in checker.attrs:
        if name in ("src", "href"):
            assert value and value.startswith("#"), (name, value)
    assert not {"link", "img", "iframe", "object"} & set(checker.tags)
    data = json.loads(page.split('<script type="application/json" id="amp-data">')[1]
                      .split("</script>")[0])
    ops = int(re.search(r"<dt>ops</dt><dd>(\d+) \(", page).group(1))
    assert sum(r[6] == 0 for r in data["rows"]) == ops > 10  # kind 0: a computation
    assert len(data["v"]) > 10 and data["tree"]["p"] == ""  # the graph and the module tree
    blocks = next(k for k in data["tree"]["k"] if k.get("n") == "blocks")
    first, fold = blocks["k"]  # the first block casts the input, the other two fold
    assert first["d"] == "plan differs from blocks 1's: linear casts: 3 here, 2 there"
    assert fold["fold"] == "blocks 1-2" and len(fold["m"]) == 2
    assert "O2 &rarr; O1" in page  # the --diff section


# ------------------------------------------------------------------------------ ONNX


def test_inspect_onnx_file(runs):
    doc = json.loads(ok(runs, "onnx_inspect").stdout)
    assert doc["kind"] == "onnx" and doc["dtype"] == "fp16"
    by_name = {n["name"]: n for n in doc["nodes"]}
    assert by_name["fc1"]["op"] == "MatMul" and by_name["fc1"]["precision"] == "fp16"
    assert by_name["softmax"]["precision"] == "fp32" and "deny" in by_name["softmax"]["reason"]
    assert by_name["x"]["op"] == "input" and by_name["W1"]["op"] == "initializer"
    s = doc["summary"]
    assert s["input_shapes"] == [[4, 16]]
    assert s["matmul_conv_flops"] == 2 * 4 * (16 * 32 + 32 * 8) == s["matmul_conv_flops_low"]
    assert s["param_bytes_baseline"] == 4 * (16 * 32 + 32 + 32 * 8)
    assert s["param_bytes_low"] == 2 * (16 * 32 + 32 + 32 * 8) and s["param_bytes_fp32"] == 0
    changed = {c["name"]: c for c in doc["diff"]["changed"]}
    assert changed["softmax"]["from"] == "fp32" and changed["softmax"]["to"] == "fp16"


def test_convert_validate_and_block_op(runs, tmp):
    out = ok(runs, "convert").stdout
    assert "wrote" in out and "O2 fp16" in out
    assert "max_abs" in out and "probs" in out and "yes" in out
    model = onnx.load(str(tmp / "mlp_fp16.onnx"))
    types = {i.name: i.data_type for i in model.graph.initializer}
    assert types["W1"] == TensorProto.FLOAT16
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    producers = {o: n for n in model.graph.node for o in n.output}
    assert producers[relu.input[0]].op_type == "Cast"  # blocked: fed back in fp32


def test_convert_without_io_types(runs, tmp):
    ok(runs, "convert_noio")
    model = onnx.load(str(tmp / "mlp_o3.onnx"))
    assert model.graph.input[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    assert model.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT16
    fc2 = next(n for n in model.graph.node if n.name == "fc2")
    producers = {o: n for n in model.graph.node for o in n.output}
    assert producers[fc2.input[0]].op_type == "Cast"  # --block-node fc2: fp32 inside O3


def test_export(runs, tmp):
    import onnxruntime as ort

    out = ok(runs, "export").stdout
    assert "wrote" in out and "O2 fp16" in out
    path = tmp / "lenet_o2.onnx"
    model = onnx.load(str(path))
    assert any(n.op_type == "Cast" for n in model.graph.node)
    assert any(i.data_type == TensorProto.FLOAT16 for i in model.graph.initializer)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {sess.get_inputs()[0].name: np.ones((3, 1, 32, 32), np.float32)})
    assert y.shape == (3, 10) and y.dtype == np.float32 and np.isfinite(y).all()


# ------------------------------------------------------------------------------ bench


def test_bench_json(runs):
    doc = json.loads(ok(runs, "bench").stdout)
    assert doc["schema"] == "ampgraph.bench/1" and doc["mode"] == "train"
    assert doc["steps"] == 2 and doc["device"] == "cpu"
    names = [r["name"] for r in doc["results"]]
    assert names == ["fp32", f"autocast {doc['dtype']}", "ampgraph O1", "ampgraph O2"]
    for r in doc["results"]:
        assert "error" not in r, r
        assert 0 < r["min_ms"] <= r["median_ms"] <= r["max_ms"]
        assert r["peak_bytes"] > 0 and r["speedup"] > 0
    assert doc["results"][0]["speedup"] == 1.0 and doc["memory_method"]


# ------------------------------------------------------------------------------ errors


def _one_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if not line.startswith("ampgraph: warning")]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    return lines[0]


def test_error_missing_file(runs):
    line = _one_line(failed(runs, "err_missing"))
    assert line == ("ampgraph inspect: error: models/no_such_model.py: no such file "
                    "(target 'models/no_such_model.py:make_model')")


def test_error_model_fails_to_build(runs):
    line = _one_line(failed(runs, "err_build"))
    assert "building the model with" in line
    assert "RuntimeError: checkpoint weights.pt not found" in line


def test_debug_shows_traceback(runs):
    err = failed(runs, "err_build_debug")
    assert "Traceback (most recent call last)" in err and "bad_factory.py" in err
    assert err.rstrip().splitlines()[-1].startswith("ampgraph inspect: error: building")


def test_error_not_an_onnx_model(runs):
    line = _one_line(failed(runs, "err_onnx"))
    assert "is not a readable ONNX model" in line or "not a valid ONNX model" in line


def test_import_ampgraph_stays_lean(runs):
    """``import ampgraph`` loads neither the CLI nor onnx/onnxruntime (tqdm comes with
    torch.hub, so it is not checked)."""
    assert ok(runs, "lean_import").stdout.strip() == "[]"
