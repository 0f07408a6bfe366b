"""ampgraph/train/replay_check.py: ReplayCheck finds what a CUDA graph would not replay
faithfully (host syncs, another branch, a tensor made before the step that moved)."""

from __future__ import annotations

import pytest
import torch

from ampgraph.train.replay_check import CaptureMismatch, ReplayCheck


def _run(fn, replays=2, **inputs):
    engine = ReplayCheck()
    handle, out = engine.capture(fn, (), inputs, prepare=lambda: None)
    for _ in range(replays):
        out = engine.replay(handle, out)
    return out


def test_a_step_on_fixed_memory_replays_and_its_outputs_stay_where_they_were():
    state = torch.zeros(3)
    x = torch.ones(3)

    def step(x):
        state.add_(x)  # made before the step, written in place: fine
        tmp = state * 2  # made in the step: a graph's own memory, any address here
        return tmp.sum()

    engine = ReplayCheck()
    handle, out = engine.capture(step, (), {"x": x}, prepare=lambda: None)
    ptr = out.data_ptr()
    out = engine.replay(handle, out)
    assert out.data_ptr() == ptr and out.item() == 12.0 and state.tolist() == [2.0] * 3


def test_a_host_sync_is_refused_at_capture():
    def step(x):
        if x.sum() > 0:  # bool(tensor): a host sync
            return x * 2
        return x

    with pytest.raises(CaptureMismatch, match="synchronises.*is_nonzero|_local_scalar_dense"):
        _run(step, x=torch.ones(2))


def test_a_tensor_that_moved_between_replays_is_found():
    box = [torch.zeros(4)]

    def step(x):
        box[0].add_(x)
        return box[0].sum()

    engine = ReplayCheck()
    handle, out = engine.capture(step, (), {"x": torch.ones(4)}, prepare=lambda: None)
    box[0] = torch.zeros(4)  # a new buffer: a graph would still write the old one
    with pytest.raises(CaptureMismatch, match="another address than at capture"):
        engine.replay(handle, out)


def test_a_python_branch_on_state_is_found():
    calls = [0]

    def step(x):
        calls[0] += 1
        return x * 2 if calls[0] == 1 else x + 2

    with pytest.raises(CaptureMismatch, match="another branch"):
        _run(step, x=torch.ones(2))


def test_prepare_runs_before_the_capture_and_before_every_replay():
    order = []
    engine = ReplayCheck()
    handle, out = engine.capture(lambda x: (order.append("run"), x + 1)[1], (torch.ones(1),),
                                 {}, prepare=lambda: order.append("prepare"))
    engine.replay(handle, out)
    assert order == ["prepare", "run", "prepare", "run"]
