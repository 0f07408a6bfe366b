"""Faithfulness: module and tensor hooks fire with real tensors, on every call, with their
effect on the output, registered before or after the first call (capture/hooks.py)."""

from __future__ import annotations

import pytest
import torch

from tests.ampgraph.faithfulness.harness import MLP, Case, check, compiled_whole, inputs, step


def hooked(register, before=True, calls=3):
    """Register ``register(model, log)`` before or after the first call; then train
    ``calls`` steps; observe the outputs, gradients and what the hooks logged."""

    def scenario(call, model):
        log = []
        if before:
            register(model, log)
        call(inputs(seed=9))
        if not before:
            register(model, log)
        log.clear()
        out = []
        for s in range(calls):
            out += step(call, model, inputs(seed=s))
        return out + [len(log), [type(t).__name__ for t in log]] + [t.float() for t in log]
    return scenario


def features(model, log):
    model.act.register_forward_hook(lambda m, args, out: log.append(out.detach()))


def doubled(model, log):
    model.act.register_forward_hook(lambda m, args, out: (log.append(out.detach()), out * 2)[1])


def shifted_input(model, log):
    model.b.register_forward_pre_hook(lambda m, args: (log.append(args[0].detach()),
                                                       (args[0] + 1,))[1])


def shifted_input_kwargs(model, log):
    def hook(m, args, kwargs):
        log.append(args[0].detach())
        return (args[0] * 0.5,), kwargs
    model.b.register_forward_pre_hook(hook, with_kwargs=True)


def scaled_gradient(model, log):
    model.act.register_full_backward_hook(
        lambda m, grad_in, grad_out: (log.append(grad_out[0].detach()), (grad_in[0] * 3,))[1])


def scaled_gradient_pre(model, log):
    model.b.register_full_backward_pre_hook(
        lambda m, grad_out: (log.append(grad_out[0].detach()), (grad_out[0] * -2,))[1])


def on_the_root(model, log):
    model.register_forward_hook(lambda m, args, out: (log.append(out.detach()), out - 1)[1])


def removed_later(call, model):
    handle = model.act.register_forward_hook(lambda m, args, out: out * 2)
    first = call(inputs())
    handle.remove()
    return [first, call(inputs())]


class TensorHook(MLP):
    """``h.register_hook`` inside forward: a gradient edited on its way back."""

    def forward(self, x):
        h = self.act(self.a(x))
        if h.requires_grad:
            h.register_hook(lambda g: g * 4)
        return self.b(h)


def global_hook(call, model):
    seen = []
    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda m, args, out: seen.append(type(m).__name__))
    try:
        out = call(inputs())
    finally:
        handle.remove()
    return [out, seen.count("MLP")]


def whole_but_the_hooked(net):
    compiled_whole(net)
    graphs, eager = net.amp_parts()
    assert [p for p, _ in graphs] == ["", "act"] and eager == [], (graphs, eager)


CASES = [
    Case("a forward hook collecting features, registered before", MLP, hooked(features),
         after=whole_but_the_hooked),
    Case("a forward hook collecting features, registered after", MLP,
         hooked(features, before=False), after=whole_but_the_hooked),
    Case("a forward hook editing the output, before", MLP, hooked(doubled)),
    Case("a forward hook editing the output, after", MLP, hooked(doubled, before=False)),
    Case("a pre-forward hook editing the input", MLP, hooked(shifted_input)),
    Case("a pre-forward hook with keyword arguments, after", MLP,
         hooked(shifted_input_kwargs, before=False)),
    Case("a full backward hook scaling the gradient", MLP, hooked(scaled_gradient)),
    Case("a backward pre-hook, registered after", MLP,
         hooked(scaled_gradient_pre, before=False)),
    Case("a forward hook on the model itself", MLP, hooked(on_the_root, before=False),
         after=compiled_whole),
    Case("a hook removed after the first call", MLP, removed_later),
    Case("a tensor hook registered in forward", TensorHook, hooked(lambda m, log: None),
         warns="registers a hook on a tensor"),
    Case("a global module forward hook", MLP, global_hook, warns="global module hooks"),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_hook(case):
    check(case)
