"""ampgraph/runtime/cuda/graphs.py: the CUDA graph engine (capture, replay) on a GPU, and
where it can capture."""

from __future__ import annotations

import pytest
import torch

from ampgraph.runtime.cuda.graphs import CudaGraphEngine, captures_on


def test_a_cpu_device_cannot_capture():
    assert not captures_on(torch.device("cpu"))
    assert captures_on(torch.device("cuda")) == torch.cuda.is_available()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_cuda_engine_captures_runs_once_and_replays():
    state = torch.zeros(3, device="cuda")
    x = torch.ones(3, device="cuda")
    engine = CudaGraphEngine()
    engine.warmup(lambda x: state.add_(x), (x,), {})
    graph, out = engine.capture(lambda x: state.add_(x) * 1, (x,), {}, prepare=lambda: None)
    assert state.tolist() == [2.0] * 3, "the capture ran the call that asked once"
    engine.replay(graph, out)
    torch.cuda.synchronize()
    assert state.tolist() == [3.0] * 3 and out.tolist() == [3.0] * 3
