"""ampgraph/runtime/base.py: the base Runtime (every op aten's own), and the registry that
names each runtime (ampgraph/runtime/__init__.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.runtime import RUNTIMES, CompiledEdges, Runtime, make_runtime
from passes.fx.runtime_ops import ATEN_ONLY


def test_the_base_runtime_routes_nothing_but_fp8_and_keeps_nothing():
    runtime = Runtime()
    assert runtime.name == "aten"
    for backend in (None, "inductor"):
        ops = runtime.ops(backend)  # the FP8 product only (for a graph with an FP8 recipe)
        assert ops == dataclasses.replace(ATEN_ONLY, fp8_linear=ops.fp8_linear)
        assert not ops.routes_weights
        assert ops.fp8_linear.__self__.cache_weights is (backend is None)
    assert runtime.working_copies() == [] and runtime.nbytes() == 0
    runtime.clear()  # nothing to drop
    edges = runtime.compiled_edges()  # a compiled graph does every edge itself
    assert edges == CompiledEdges() and edges.weight_copy is edges.output_cast is None


def test_make_runtime_builds_a_new_runtime_of_each_registered_kind():
    assert set(RUNTIMES) == {"aten", "cpu", "cuda"}
    for name, cls in RUNTIMES.items():
        made = make_runtime(name)
        assert type(made) is cls and made.name == name and issubclass(cls, Runtime)
        assert make_runtime(name) is not made
    with pytest.raises(ValueError, match=r"unknown runtime 'tpu': choose one of aten, cpu, cuda"):
        make_runtime("tpu")


def test_a_module_compiled_for_the_aten_runtime_casts_in_the_graph():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    net = ampgraph.compile(model, "O2", "bf16", runtime="aten")
    x = torch.randn(3, 8)
    out = net(x)
    out.sum().backward()
    assert type(net._amp_runtime) is Runtime and net.working_copies() == []
    gm = net._amp_last.captured.gm
    casts = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert len(casts) >= 4  # the input and the four parameters, in the graph itself
    torch.testing.assert_close(out, model(x), rtol=2e-2, atol=2e-2)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
