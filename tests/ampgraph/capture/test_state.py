"""ampgraph/capture/state.py: capture leaves the process as it found it."""

from __future__ import annotations

import random

import pytest
import torch

import ampgraph
from ampgraph.capture import preserved_global_state
from ampgraph.capture.state import DIM_MARKS
from tests.helpers import global_state


def test_failing_export_restores_every_piece_of_global_state(monkeypatch):
    """An export that leaves grad off, autocast on, inference mode entered, the default
    dtype changed, RNG consumed and a mode on the stack, then raises, changes nothing."""
    real_export = torch.export.export

    def leaky_export(*args, **kwargs):
        # entered, never exited (made first: its late destructor puts back a clean state)
        leaky_export.guard = torch._C._InferenceMode(True)
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.float16)
        torch.set_autocast_cache_enabled(False)
        torch.autocast_increment_nesting()
        torch.set_default_dtype(torch.float64)
        torch.rand(3)
        random.random()
        raise RuntimeError("export failed on purpose")

    monkeypatch.setattr(torch.export, "export", leaky_export)
    net = ampgraph.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), dtype="bf16")
    before = global_state()
    torch.manual_seed(5)
    random.seed(5)
    x = torch.randn(2, 4)
    expected = torch.rand(2), random.random()
    torch.manual_seed(5)
    random.seed(5)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="export failed on purpose"):
        net(x)  # capture fails, the Linear child's too; it runs eagerly
    monkeypatch.setattr(torch.export, "export", real_export)
    assert global_state() == before
    nesting = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    assert nesting == 1
    # the capture attempts consumed no random numbers (the eager forward draws none)
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    del leaky_export.guard
    assert global_state() == before


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "autocast"])
def test_preserved_global_state_is_transparent_inside_user_contexts(context):
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
           "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[context]
    with ctx():
        before = global_state()
        with preserved_global_state():
            assert global_state() == before  # the body sees the caller's state
            torch.set_grad_enabled(not torch.is_grad_enabled())
            torch.set_default_dtype(torch.float64)
        assert global_state() == before
    with pytest.raises(ValueError), preserved_global_state():
        torch.set_grad_enabled(False)
        raise ValueError
    assert torch.is_grad_enabled()


def test_preserved_global_state_restores_rng():
    torch.manual_seed(3)
    random.seed(3)
    with preserved_global_state():
        torch.rand(5)
        random.random()
    a = torch.rand(2), random.random()
    torch.manual_seed(3)
    random.seed(3)
    assert torch.equal(a[0], torch.rand(2)) and a[1] == random.random()


def test_rng_is_left_alone_when_not_asked_for():
    torch.manual_seed(3)
    with preserved_global_state(rng=False):
        torch.rand(5)
    after = torch.rand(2)
    torch.manual_seed(3)
    torch.rand(5)
    assert torch.equal(after, torch.rand(2))


def test_a_function_mode_left_on_the_stack_is_popped():
    from torch.overrides import TorchFunctionMode

    function_modes = torch._C._len_torch_function_stack()
    with preserved_global_state():
        TorchFunctionMode().__enter__()  # entered, never exited
    assert torch._C._len_torch_function_stack() == function_modes


def test_a_dispatch_mode_left_on_the_stack_is_popped():
    from torch.utils._python_dispatch import TorchDispatchMode

    dispatch_modes = torch._C._len_torch_dispatch_stack()
    try:
        with preserved_global_state():
            TorchDispatchMode().__enter__()  # entered, never exited
    finally:
        while torch._C._len_torch_dispatch_stack() > dispatch_modes:  # leave none behind
            torch._C._pop_torch_dispatch_stack(None)
    assert torch._C._len_torch_dispatch_stack() == dispatch_modes


def test_a_binding_without_the_mode_key_is_called_without_it(monkeypatch):
    """torch before 2.13 may take no argument: the pop is tried with None, then without."""
    from torch.utils._python_dispatch import TorchDispatchMode

    real = torch._C._pop_torch_dispatch_stack
    calls = []

    def no_key(*args):
        calls.append(args)
        if args:
            raise TypeError("_pop_torch_dispatch_stack() takes no arguments (1 given)")
        return real(None)

    dispatch_modes = torch._C._len_torch_dispatch_stack()
    monkeypatch.setattr(torch._C, "_pop_torch_dispatch_stack", no_key)
    with preserved_global_state():
        TorchDispatchMode().__enter__()
    assert torch._C._len_torch_dispatch_stack() == dispatch_modes and calls == [(None,), ()]


def test_the_rest_of_the_state_is_restored_when_one_piece_fails(monkeypatch):
    """A restore that raises does not stop the others; its error is raised after them."""
    before = global_state()
    torch.manual_seed(3)
    random.seed(3)
    expected = torch.rand(2), random.random()
    torch.manual_seed(3)
    random.seed(3)
    real_set_dtype = torch.set_default_dtype
    failing = {"on": False}

    def set_default_dtype(dtype):
        if failing["on"]:
            raise RuntimeError("cannot set the default dtype")
        real_set_dtype(dtype)

    monkeypatch.setattr(torch, "set_default_dtype", set_default_dtype)
    with pytest.raises(RuntimeError, match="cannot set the default dtype") as info, \
            preserved_global_state():
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.rand(5)
        random.random()
        real_set_dtype(torch.float64)
        failing["on"] = True
        raise ValueError("the body failed")
    assert isinstance(info.value.__context__, ValueError)  # the body's error, kept
    assert torch.get_default_dtype() == torch.float64  # the piece that failed
    real_set_dtype(before[2])
    assert global_state() == before  # every other piece is back
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]


def test_a_failed_export_leaves_no_dimension_marks_on_the_inputs():
    """torch.export marks the dimensions it makes dynamic on the input tensors and, when it
    fails, leaves the marks: a later export of the same tensors made them dynamic again."""
    class BranchesOnData(torch.nn.Module):
        def forward(self, x):
            return x * 2 if x.sum() > 0 else x * 3

    x = torch.randn(3, 4)
    net = ampgraph.compile(BranchesOnData())
    net(x)
    assert net.amp_parts()[1]  # export failed: the module ran eagerly
    assert not [a for a in DIM_MARKS if a in x.__dict__]
