"""The benchmark harnesses run end to end (tiny sizes; no timing is asserted)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


@pytest.mark.slow
def test_perf_harness_smoke_mode_writes_every_mode(tmp_path):
    out = tmp_path / "perf.json"
    proc = run("benchmarks/perf.py", "--smoke", "--models", "mlp", "--levels", "O2",
               "--json", str(out))  # one model: each mode's memory probe is a process
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    for model in ("mlp",):
        entry = data["models"][model]
        assert set(entry["train"]) == {"fp32", "autocast", "O2", "floor"}
        assert all(v["median_ms"] > 0 for v in entry["infer"].values())
        assert set(entry["peak_mib"]) == {"fp32", "autocast", "O2", "floor"}
        assert all(v["tensors"] > 0 and "rss" in v for v in entry["peak_mib"].values())
    assert "x autocast" in proc.stdout


@pytest.mark.slow
def test_compile_scaling_smoke(tmp_path):
    out = tmp_path / "scaling.json"
    proc = run("benchmarks/compile_scaling.py", "--sizes", "100,400", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["nodes"] > 0 for r in rows] == [True, True]


@pytest.mark.slow
def test_capture_time_reports_each_model_captured_whole(tmp_path):
    out = tmp_path / "capture.json"
    proc = run("benchmarks/capture_time.py", "--models", "swin,bert", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["model"] for r in rows] == ["swin", "bert"]
    for row in rows:
        assert row["eager_parts"] == 0 and row["nodes"] > 0 and row["cos"] > 0.99
        assert row["total_s"] >= row["export_s"] + row["passes_s"] > 0


@pytest.mark.slow
def test_real_models_harness_smoke_mode(tmp_path):
    out = tmp_path / "real.json"
    proc = run("benchmarks/real_models.py", "--smoke", "--models", "bert", "--modes",
               "fp32,autocast,O2", "--no-memory", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["models"]) == {"bert"}
    for entry in data["models"].values():
        assert set(entry["train"]) == set(entry["infer"]) == {"fp32", "autocast", "O2"}
        assert all(v["median_ms"] > 0 for v in entry["train"].values())
    assert data["geomean_o2_vs_autocast"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("processes, models", [("0", "convnext,resnet50"), ("1", "convnext")])
def test_cnn_suite_smoke_in_one_process_and_in_processes_of_their_own(tmp_path, processes,
                                                                      models):
    out = tmp_path / "cnn.json"
    proc = run("benchmarks/real_models.py", "--suite", "cnn", "--smoke", "--no-memory",
               "--processes", processes, "--models", models, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["batch"] == 8 and data["processes"] == int(processes)
    assert set(data["models"]) == set(models.split(","))
    for entry in data["models"].values():
        assert set(entry["train"]) == set(entry["infer"]) == {"autocast", "O2"}
    assert "ConvNeXt" in data["models"]["convnext"]["source"]


@pytest.mark.slow
def test_gpu_suite_smoke_on_the_cpu_writes_a_line_per_measurement(tmp_path):
    """``--device cuda --suite gpu`` with the device swapped for the CPU and tiny configs:
    every mode of every model measured, and written line by line."""
    out = tmp_path / "gpu.jsonl"
    proc = run("benchmarks/real_models.py", "--suite", "gpu", "--device", "cpu", "--smoke",
               "--models", "bert,llama", "--modes", "fp32,autocast,O2,O2-fp16,floor",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["kind"] == "machine" and rows[-1]["kind"] == "geomean"
    results = [r for r in rows if r["kind"] == "result"]
    assert {(r["model"], r["mode"]) for r in results} == {
        (m, mode) for m in ("bert", "llama")
        for mode in ("fp32", "autocast", "O2", "O2-fp16", "floor")}
    for r in results:
        assert r["train_ms"] > 0 and r["infer_ms"] > 0 and r["train_host_ms"] > 0
        assert r["copy_"] + r["_to_copy"] > 0 and r["eval_cosine_vs_fp32"] > 0.99
    assert all(r["working_copies_mib"] >= 0 for r in results if r["mode"].startswith("O2"))


@pytest.mark.slow
def test_numerics_quick_mode_reports_both_stories(tmp_path):
    out = tmp_path / "numerics.json"
    proc = run("benchmarks/numerics.py", "--quick", "--json", str(out), "--plots", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    scaling = data["loss_scaling"]
    for kind in ("dynamic", "adaptive", "adaptive per_layer"):
        assert scaling[kind]["skipped"] >= data["config"]["burst"]
        assert len(scaling[kind]["scale"]) == data["config"]["steps"]
    for task in ("digits", "transformer"):
        rows = data["weights"][task]
        assert rows["kahan"]["bytes_per_param"] < rows["fp32 masters"]["bytes_per_param"]
    assert (tmp_path / "numerics_loss_scale.png").exists()


@pytest.mark.slow
def test_onnx_convert_speed_smoke(tmp_path):
    """A one-layer BERT of width 32, exported once into tmp_path, one run per tool."""
    out = tmp_path / "speed.json"
    proc = run("benchmarks/onnx_convert_speed.py", "--tiny", "--repeat", "1",
               "--cache", str(tmp_path), "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert set(data["tools"]) == {"ampgraph", "onnxconverter-common"}
    assert all(v["median_s"] > 0 for v in data["tools"].values())
    phases = data["ampgraph_phases_median_s"]  # every wrapped phase was found and ran
    assert {"load + input check", "rewrite (casts, initializers)", "verify"} <= set(phases)
    assert phases["rewrite (casts, initializers)"] > 0 and phases["verify"] > 0
    assert "ampgraph by phase" in proc.stdout


def test_packed_linear_smoke():
    proc = run("benchmarks/packed_linear.py", "--smoke")
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "max |diff|" in line]
    assert len(lines) == 2 or "does not run" in proc.stdout, proc.stdout


@pytest.mark.slow
def test_hf_sweep_runs_each_architecture_in_its_own_process(tmp_path):
    """Three tiny architectures of transformers' auto mappings, each in a worker process:
    one JSON line per architecture between the meta and summary lines, every criterion but
    the (machine-dependent) compile time met, and the summary printed and written."""
    out, md = tmp_path / "sweep.jsonl", tmp_path / "sweep.md"
    proc = run("benchmarks/hf_sweep.py", "--only", "bert,gpt2,vit", "--json", str(out),
               "--markdown", str(md))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["record"] for r in lines] == ["meta"] + ["architecture"] * 3 + ["summary"]
    rows = {r["arch"]: r for r in lines[1:-1]}
    assert {(a, r["kind"]) for a, r in rows.items()} == {("bert", "causal"),
                                                         ("gpt2", "causal"), ("vit", "image")}
    for name, row in rows.items():
        assert row["status"] == "counted" and row["errors"] == {}, (name, row)
        assert row["capture"]["status"] == row["capture_train"]["status"] == "whole graph"
        checks = row["criteria"]
        assert set(checks) == {"whole graph", "eval", "grad", "grad mode", "time"}
        assert all(v for k, v in checks.items() if k != "time"), (name, checks)
        assert row["o2_grads_finite"] and row["compile_s"] > 0
        assert 0.99 <= row["o2_eval_cos"] <= 1.0 + 1e-9, (name, row["o2_eval_cos"])
    summary = lines[-1]["text"]
    assert summary.startswith("3 architectures: 3 counted, 0 listed apart")
    assert summary in proc.stdout and "| gpt2 | causal | GPT2LMHeadModel |" in md.read_text()


@pytest.mark.slow
def test_hf_sweep_lists_a_timed_out_architecture_apart(tmp_path):
    """A worker killed at its timeout before its fp32 reference leaves a row listed apart."""
    out = tmp_path / "sweep.jsonl"
    proc = run("benchmarks/hf_sweep.py", "--only", "gpt2", "--timeout", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(out.read_text().splitlines()[1])
    assert row["status"] == "apart" and row["reason"].startswith("timeout (1 s)"), row
    assert "1 x timeout (1 s)" in proc.stdout


def test_code_ab_compares_two_checkouts_step_by_step(tmp_path):
    out = tmp_path / "ab.json"
    proc = run("benchmarks/code_ab.py", "--before", str(ROOT), "--smoke", "--steps", "1",
               "--models", "llama", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    models = json.loads(out.read_text())["models"]
    assert set(models) == {"llama"}
    for r in models.values():
        assert set(r["ms"]) == {"before train", "before infer", "current train", "current infer"}
        assert all(v > 0 for v in r["before/current"].values())


@pytest.mark.slow
def test_distributed_harness_smoke(tmp_path):
    out = tmp_path / "dist.json"
    proc = run("benchmarks/distributed.py", "--setups", "fsdp-bf16,ampgraph", "--hidden", "64",
               "--layers", "1", "--vocab", "128", "--seq", "16", "--steps", "1", "--world", "1",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {(r["setup"], r["rank"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {("fsdp-bf16", 0), ("ampgraph", 0)}  # one rank: nothing to gather
    assert all(r["step_ms"] > 0 and r["peak_mib"] > 0 and len(r["losses"]) == 2
               for r in rows.values())  # (the bytes on 2 and 4 ranks: tests/ampgraph/parallel)


@pytest.mark.slow
def test_saved_activations_smoke():
    pytest.importorskip("transformers")
    proc = run("benchmarks/saved_activations.py", "--smoke")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r.split(" | ")[0] for r in rows[1:]] == ["| eager fp32", "| eager bf16",
                                                   "| ampgraph O2"]
    assert "O2 with checkpointing / eager bf16 with checkpointing" in proc.stdout


@pytest.mark.slow
def test_fp8_numerics_smoke(tmp_path):
    out = tmp_path / "fp8.json"
    proc = run("benchmarks/fp8_numerics.py", "--smoke", "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert set(runs) == {"fp32", "bf16", "fp8"}
    for rec in runs.values():  # same init, same data: the first losses agree
        assert len(rec["train_loss"]) == 4 and rec["val_steps"] == [0, 2, 4]
        assert abs(rec["val_loss"][0] - runs["fp32"]["val_loss"][0]) < 1e-2
    # one block's proj, fc1, fc2: its qkv is the first product, the head the last (bf16)
    assert runs["fp8"]["fp8_modules"] == ["blocks.0.fc1", "blocks.0.fc2", "blocks.0.proj"]
    err = data["fp8_vs_bf16"]
    assert set(err["per_layer"]) == set(runs["fp8"]["fp8_modules"])
    assert all(0 < v["rel_err"] < 0.2 for v in err["per_layer"].values())
    assert 0 < err["logits_rel_err"] < 0.2
    assert [c["check"] for c in data["checks"]][-1] == "fp8 final val loss within 1% of bf16's"


@pytest.mark.slow
def test_memory_benchmark_counts_each_mode_in_a_fresh_process(tmp_path):
    pytest.importorskip("transformers")
    out, png = tmp_path / "memory.json", tmp_path / "memory.png"
    proc = run("benchmarks/memory.py", "--smoke", "--modes", "autocast,floor,step,step-lean",
               "--json", str(out), "--plot", str(png))
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = {r["mode"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["autocast", "floor", "step", "step-lean"] and png.stat().st_size
    n = rows["autocast"]["params"]
    for r in rows.values():
        parts = r["fixed_parts"]
        assert r["total"] == r["fixed"] + r["transient"] and r["transient"] > 0
        assert r["fixed"] == sum(parts.values()) and parts["other_kept"] >= 0
        assert parts["parameters"] == n * (2 if r["mode"] == "floor" else 4)
    assert rows["autocast"]["fixed_parts"]["gradients_kept"] == 0
    assert rows["step"]["fixed_parts"]["gradients_kept"] == 4 * n  # kept to be inspected
    assert rows["step-lean"]["fixed_parts"]["gradients_kept"] == 0  # released in backward
    assert rows["step"]["losses"] == pytest.approx(rows["autocast"]["losses"], rel=0.02)


@pytest.mark.slow
def test_lean_parity_smoke_trains_every_tier_from_one_init(tmp_path):
    out = tmp_path / "parity.json"
    proc = run("benchmarks/lean_parity.py", "--smoke", "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert list(runs) == ["unfused", "fused", "lean", "stochastic", "leanest"]
    assert [r["fused"] for r in runs.values()] == [False, True, True, True, True]
    first = runs["unfused"]["val_loss"][0]
    assert all(abs(r["val_loss"][0] - first) < 1e-3 for r in runs.values())  # one init
    assert len(data["checks"]) == 4 and all(ok for _, ok, _ in data["checks"])


@pytest.mark.slow
def test_head_loss_speed_times_both_steps_side_by_side():
    pytest.importorskip("transformers")
    proc = run("benchmarks/head_loss_speed.py", "--models", "tiny", "--steps", "1",
               "--warmup", "0")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "tiny: unfused" in proc.stdout and "fused" in proc.stdout.split("unfused")[-1]


def test_memory_fp32_products_compute_the_16_bit_products_into_their_results(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import memory

    monkeypatch.setattr(memory.Fp32Products, "BLOCK", 64)  # many blocks, ragged edges
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(3, 37, 16, generator=g).bfloat16() for _ in range(2))
    w, bias = torch.randn(29, 16, generator=g).bfloat16(), torch.randn(29).bfloat16()
    out = torch.empty(37, 29, dtype=torch.bfloat16)
    want = [a[0] @ w.t(), torch.addmm(bias, a[0], w.t()), torch.bmm(a, b.transpose(1, 2)),
            a[1] @ w.t()]
    with memory.Fp32Products():
        got = [a[0] @ w.t(), torch.addmm(bias, a[0], w.t()), torch.bmm(a, b.transpose(1, 2)),
               torch.mm(a[1], w.t(), out=out)]
    assert got[3] is out
    for x, y in zip(got, want):
        assert x.dtype == torch.bfloat16 and x.shape == y.shape
        assert torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-2)
