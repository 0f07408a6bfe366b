"""Concurrency: threads sharing one compiled module get what sequential calls get.

Threads start together (a barrier) so the first call, the capture, the weight cache and the
eager fallback all race. Results are compared with a second, identically built module
called sequentially; the per-(mode, input structure) graph cache must hold one graph per
structure, whatever the interleaving.
"""

from __future__ import annotations

import random
import threading
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.onnx import convert_onnx
from tests.reliability.onnx_programs import build_onnx_model, random_onnx_program
from tests.reliability.strategies import FuzzNet, example_inputs, random_fx_program

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
THREADS = 4
ROUNDS = 5


def in_threads(work: Callable[[int], Any], n: int = THREADS) -> list[Any]:
    """Run ``work(i)`` in ``n`` threads released together; re-raise the first error."""
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as exc:  # re-raised in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def calls(i: int, program) -> list[tuple[tuple, dict]]:
    """Thread ``i``'s calls: positional or keyword inputs (two input structures), two batch
    sizes (one dynamic graph each structure)."""
    x, y = example_inputs(program, batch=2 + i % 2)
    return [((x, y), {}) if (i + r) % 2 else ((x,), {"y": y}) for r in range(ROUNDS)]


@pytest.mark.parametrize("seed", [3, 11, 12])
def test_threads_share_one_module_and_its_capture_cache(seed):
    program = random_fx_program(random.Random(seed))
    shared = ampgraph.compile(FuzzNet(program).eval(), "O2", "bf16")
    sequential = ampgraph.compile(FuzzNet(program).eval(), "O2", "bf16")

    def work(i: int) -> list:
        with torch.no_grad():
            return [shared(*a, **k) for a, k in calls(i, program)]

    got = in_threads(work)
    with torch.no_grad():
        want = [[sequential(*a, **k) for a, k in calls(i, program)] for i in range(THREADS)]
    for g_thread, w_thread in zip(got, want):
        for g, w in zip(g_thread, w_thread):
            for a, b in zip(g, w):
                assert torch.equal(a, b)
    assert shared._amp_eager is None
    assert sorted(len(v) for v in shared._amp_graphs.values()) == [1, 1], \
        "one graph per input structure, however the first calls interleave"


def test_concurrent_training_accumulates_like_sequential_calls():
    program = random_fx_program(random.Random(5))
    models = [FuzzNet(program).train() for _ in range(2)]
    shared = ampgraph.compile(models[0], "O2", "bf16")
    sequential = ampgraph.compile(models[1], "O2", "bf16")
    inputs = [example_inputs(program) for _ in range(THREADS)]
    for i in range(THREADS):
        inputs[i] = tuple(t + i for t in inputs[i])

    def loss(net: nn.Module, i: int) -> torch.Tensor:
        return sum(o.square().mean() for o in net(*inputs[i]))

    in_threads(lambda i: loss(shared, i).backward())
    for i in range(THREADS):
        loss(sequential, i).backward()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
    # BatchNorm running statistics see every batch once, in some order
    for (name, b), c in zip(models[0].named_buffers(), models[1].buffers()):
        if name.endswith("num_batches_tracked"):
            assert int(b) == int(c) == THREADS


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.sum().item() > -1e9:
            h = self.b(torch.relu(h))
        return h


def test_eager_fallback_races_safely():
    torch.manual_seed(0)
    model = Untraceable().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    xs = [torch.randn(3, 8) for _ in range(THREADS)]

    def infer(i: int) -> list[torch.Tensor]:
        with torch.no_grad():  # grad mode is per thread
            return [net(xs[i]) for _ in range(ROUNDS)]

    got = in_threads(infer)
    with torch.no_grad():
        reference = ampgraph.compile(Untraceable().eval(), "O2", "bf16")
        reference.load_state_dict(model.state_dict())
        for i, outs in enumerate(got):
            want = reference(xs[i])
            assert all(torch.equal(o, want) for o in outs)
    children = [c for c in net._amp_eager.children() if isinstance(c, ampgraph.AmpModule)]
    assert len(children) == 2 and all(len(c._amp_graphs) == 1 for c in children)


def test_weight_cache_is_filled_once_under_concurrent_inference():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(4, 16)

    def infer(i: int) -> list[torch.Tensor]:
        with torch.no_grad():  # grad mode is per thread
            return [net(x) for _ in range(ROUNDS)]

    outs = in_threads(infer)
    with torch.no_grad():
        ref = model(x)
    assert all(torch.equal(o, outs[0][0]) for per in outs for o in per)
    torch.testing.assert_close(outs[0][0], ref, rtol=2e-2, atol=2e-2)
    params = sum(p.numel() for p in model.parameters())
    assert net._amp_runtime.weights.nbytes() == 2 * params, "one bf16 copy per parameter"
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a weight update reaches every thread's next call
        ref = model(x)
    fresh = [per[0] for per in in_threads(infer)]
    assert all(torch.equal(f, fresh[0]) for f in fresh)
    torch.testing.assert_close(fresh[0], ref, rtol=2e-2, atol=5e-2)
    assert net._amp_runtime.weights.nbytes() == 2 * params, "the stale copies were replaced"


def test_threads_converting_one_onnx_model():
    model = build_onnx_model(random_onnx_program(random.Random(7)))
    before = model.SerializeToString()

    def work(i: int) -> bytes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return convert_onnx(model, ("O1", "O2")[i % 2], "fp16").SerializeToString()

    got = in_threads(work)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        want = [convert_onnx(model, lv, "fp16").SerializeToString() for lv in ("O1", "O2")]
    assert all(g == want[i % 2] for i, g in enumerate(got))
    assert model.SerializeToString() == before, "the input model was modified"


def test_two_training_forwards_racing_for_the_weight_buffer(monkeypatch):
    """The race made deterministic: both threads pick the weight's buffer before either casts
    into it; thread 1 casts after thread 0's forward, so thread 0's saved weight is
    overwritten in place before its backward."""
    from ampgraph.runtime.cpu.cast import CastInto

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))  # backward reads layer 1's weight
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(2, 8)
    net(x).sum().backward()  # capture once, single-threaded
    model.zero_grad()
    both_picked = threading.Barrier(2)
    forward_done = [threading.Event(), threading.Event()]
    who = threading.local()
    real = CastInto.apply

    def apply_after_both_picked(param: torch.Tensor, buffer: torch.Tensor, *rest
                                ) -> torch.Tensor:
        if param is model[1].weight:
            try:
                both_picked.wait(timeout=2)
            except threading.BrokenBarrierError:  # a fixed cache may hold its lock here
                pass
            if who.i == 1:
                forward_done[0].wait(timeout=10)
        return real(param, buffer, *rest)

    def work(i: int) -> None:
        who.i = i
        out = net(x * (i + 1))
        forward_done[i].set()
        forward_done[1 - i].wait(timeout=10)
        out.sum().backward()

    monkeypatch.setattr(CastInto, "apply", apply_after_both_picked)
    in_threads(work, n=2)
    sequential = ampgraph.compile(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), "O2", "bf16")
    sequential.load_state_dict(model.state_dict())
    for i in range(2):
        sequential(x * (i + 1)).sum().backward()
    for p, q in zip(model.parameters(), sequential.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
