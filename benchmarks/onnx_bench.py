"""ONNX mixed-precision benchmark: ampgraph.convert_onnx vs onnxconverter-common.

For every reference model: export FP32 with torch.onnx (dynamo), convert to fp16 with
ampgraph (O2) and with onnxconverter-common's ``convert_float_to_float16(keep_io_types=True)``
given the same FP32 op block list (the op types ampgraph keeps in FP32 plus
onnxconverter-common's default block list, passed to both), then report Cast nodes, file
size, accuracy against torch FP32, conversion time and, with a usable CUDA provider,
fp32 vs fp16 latency.

Usage:
    python benchmarks/onnx_bench.py [--models resnet bert_encoder] [--batch 64] [--runs 50]

This is a benchmark, not a test; numbers vary run to run. Accuracy is measured on the
onnxruntime provider used for latency (CPU when there is no GPU: the CPU provider runs most
fp16 ops in fp32, so it understates the fp16 error a GPU shows).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ampgraph.onnx import convert_onnx, cuda_usable, export_onnx, onnx_session  # noqa: E402
from passes.onnx import convert_model  # noqa: E402

MODELS = ("lenet5", "tabular_mlp", "resnet", "unet", "bert_encoder", "gpt_decoder")


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "models" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module


def cast_count(model: onnx.ModelProto) -> int:
    return sum(n.op_type == "Cast" for n in model.graph.node)


def accuracy(path: Path, args: tuple, ref: np.ndarray, device: str) -> str:
    try:
        sess = onnx_session(path, device)
        got = sess.run(None, {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)})[0]
    except Exception as exc:  # report, do not crash: this is what users hit
        return f"fails: {str(exc).splitlines()[0][:60]}"
    got = got.astype(np.float64)
    rel = np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-12)
    cos = got.ravel() @ ref.ravel() / (np.linalg.norm(got) * np.linalg.norm(ref))
    return f"{rel:.1e} / {cos:.5f}"


def latency_ms(path: Path, args: tuple, runs: int) -> float:
    sess = onnx_session(path, "cuda")
    feeds = {i.name: a.numpy() for i, a in zip(sess.get_inputs(), args)}
    for _ in range(5):
        sess.run(None, feeds)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def bench(name: str, folder: Path, batch: int, runs: int) -> dict:
    from onnxconverter_common import float16

    module = load(name)
    model = module.make_model().eval()
    args = module.example_inputs()
    with torch.no_grad():
        out = model(*args)
    ref = (out if isinstance(out, torch.Tensor) else out[0]).numpy().astype(np.float64)
    fp32_path = folder / f"{name}_fp32.onnx"
    fp32 = export_onnx(model, args, fp32_path, amp_level="O0")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        painted = convert_model(fp32, "O2")
    nodes = {n.name: n.op_type for n in painted.model.graph.node}
    kept = {nodes[v] for v, d in painted.assignment.items()  # op types kept fp32 by class
            if d.precision == "fp32" and d.cls == "deny" and v in nodes}
    block = sorted(kept | set(float16.DEFAULT_OP_BLOCK_LIST))

    ours_path, theirs_path = folder / f"{name}_ampgraph.onnx", folder / f"{name}_occ.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        ours = convert_onnx(fp32, "O2", op_block_list=block, output_path=ours_path)
        t_ours = time.perf_counter() - start
        start = time.perf_counter()
        theirs = float16.convert_float_to_float16(fp32, keep_io_types=True, op_block_list=block)
        t_theirs = time.perf_counter() - start
    onnx.save_model(theirs, str(theirs_path))
    device = "cuda" if cuda_usable() else "cpu"
    row = {
        "model": name,
        "casts ampgraph": cast_count(ours),
        "casts occ": cast_count(theirs),
        "MB fp32": fp32_path.stat().st_size / 1e6,
        "MB ampgraph": ours_path.stat().st_size / 1e6,
        "MB occ": theirs_path.stat().st_size / 1e6,
        "err/cos ampgraph": accuracy(ours_path, args, ref, device),
        "err/cos occ": accuracy(theirs_path, args, ref, device),
        "ms convert ampgraph": t_ours * 1e3,
        "ms convert occ": t_theirs * 1e3,
    }
    if device == "cuda":
        big = module.example_inputs(batch)
        row["cuda ms fp32"] = latency_ms(fp32_path, big, runs)
        row["cuda ms fp16"] = latency_ms(ours_path, big, runs)
    return row


def table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for row in rows for k in row))
    fmt = lambda v: f"{v:.2f}" if isinstance(v, float) else str(v)
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row.get(k, "n/a")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--batch", type=int, default=64, help="batch size for GPU latency")
    parser.add_argument("--runs", type=int, default=50, help="timed runs for GPU latency")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = [bench(name, Path(tmp), opts.batch, opts.runs) for name in opts.models]
    print(table(rows))
    worse = [r["model"] for r in rows if r["casts ampgraph"] > r["casts occ"]]
    print(f"\nprovider: {'CUDA' if cuda_usable() else 'CPU (no CUDA GPU: no latency columns)'}; "
          "err = max |ours - torch fp32| / max |torch fp32|; occ = onnxconverter-common")
    if worse:
        print(f"ampgraph uses more Casts than onnxconverter-common on: {', '.join(worse)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
