"""ampgraph/capture/hooks.py: submodules with hooks are cut out of the graph; hooks run
through the module's own ``__call__``, ``module`` being the user's module."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import nn
from torch.nn.modules import module as module_mod

from ampgraph.capture.hooks import (
    call_with_hooks,
    cut_route,
    forward_of,
    has_untraced_hooks,
    quiet_global_hooks,
    traced_hook,
)
from ampgraph.capture.opaque import opaque_nodes, release
from ampgraph.capture.watch import watching


def test_which_hooks_are_traced():
    def user(m, i, o):
        return o

    assert not traced_hook(user) and not traced_hook(functools.partial(user))
    from transformers.utils import output_capturing

    captured = output_capturing.install_output_capuring_hook
    fn = nn.Linear(2, 2)
    captured(fn, "hidden_states", 0)
    (hook,) = fn._forward_hooks.values()
    assert traced_hook(hook) and not has_untraced_hooks(fn)
    fn.register_forward_hook(user)
    assert has_untraced_hooks(fn)


def test_call_with_hooks_runs_the_modules_hooks_around_another_forward():
    fc = nn.Linear(2, 2)
    seen = []
    fc.register_forward_pre_hook(lambda m, args: seen.append(m) or (args[0] * 2,))
    fc.register_forward_hook(lambda m, args, out: out + 1)
    out = call_with_hooks(fc, lambda x: x * 10, (torch.ones(1, 2),), {})
    assert torch.equal(out, torch.full((1, 2), 21.0)) and seen == [fc]
    assert "forward" not in fc.__dict__, "the shadow is gone"
    assert forward_of(fc).__func__ is nn.Linear.forward


def test_a_hooked_submodule_is_one_opaque_node():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    model[1].register_forward_hook(lambda m, a, o: o)
    with watching(model, cut_route(model)) as watch:
        gm = torch.export.export(model, (torch.randn(2, 4),), strict=False).module()
    release(watch.emitted)
    (node,) = opaque_nodes(gm)
    assert node.meta.get("amp_orig_op") is None  # described by export_module, not here
    assert [n for n in gm.graph.nodes if "relu" in str(n.target)] == []


def test_global_hooks_are_quiet_while_exporting_and_back_afterwards():
    calls = []
    handle = module_mod.register_module_forward_hook(lambda *a: calls.append(1))
    try:
        with pytest.warns(UserWarning, match="global module hooks"), quiet_global_hooks("m"):
            nn.Linear(2, 2)(torch.ones(1, 2))
        assert calls == []
        nn.Linear(2, 2)(torch.ones(1, 2))
        assert calls == [1]
    finally:
        handle.remove()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with quiet_global_hooks("m"):  # none registered: no warning
            pass
