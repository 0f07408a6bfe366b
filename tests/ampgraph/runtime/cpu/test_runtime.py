"""ampgraph/runtime/cpu/runtime.py: CpuRuntime hands the passes its ops and owns what they
keep between calls."""

from __future__ import annotations

import torch
from torch import nn

import ampgraph
from ampgraph.runtime.cpu.attention import amp_attention
from ampgraph.runtime.cpu.dropout import amp_dropout
from ampgraph.runtime.cpu.runtime import CpuRuntime


def test_eager_graphs_get_every_cpu_op():
    runtime = CpuRuntime()
    ops = runtime.ops(backend=None)
    assert ops.weight_cast == runtime.weights.cast and ops.linear == runtime.weights.amp_linear
    assert ops.embedding == runtime.weights.amp_embedding
    assert ops.output_cast == runtime.outputs.cast
    assert ops.attention is amp_attention and ops.dropout is amp_dropout
    assert ops.unrepeated_kv_heads and ops.routes_weights and ops.weight_group is None


def test_a_compile_backend_gets_only_the_traceable_attention():
    ops = CpuRuntime().ops(backend="inductor")
    assert ops.attention is amp_attention and ops.unrepeated_kv_heads
    assert not ops.routes_weights and ops.dropout is None and ops.output_cast is None


def test_around_a_compiled_graph_the_cpu_runtime_does_the_weights_and_the_outputs():
    runtime = CpuRuntime()
    edges = runtime.compiled_edges()
    assert edges.weight_copy == runtime.weights.cast
    assert edges.output_cast == runtime.outputs.cast
    assert edges.output_linear == runtime.outputs.linear


def test_nbytes_and_clear_cover_the_weights_and_the_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    net = ampgraph.compile(model, "O2", "bf16", runtime="cpu")
    with torch.no_grad():
        net(torch.randn(4, 16))
    runtime = net._amp_runtime
    assert type(runtime) is CpuRuntime and runtime.name == "cpu"
    assert runtime.nbytes() == runtime.weights.nbytes() + runtime.outputs.nbytes() > 0
    assert runtime.working_copies() == runtime.weights.train_copies()
    runtime.clear()
    assert runtime.nbytes() == 0
