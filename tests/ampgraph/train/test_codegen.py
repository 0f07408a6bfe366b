"""ampgraph/train/codegen.py: the generated step's source per StepSpec (eager, and the phases
of a step captured as CUDA graphs) and its compilation."""

from __future__ import annotations

import builtins
import dataclasses
import itertools
import linecache
import symtable
import traceback

import pytest
import torch
from torch import nn

from ampgraph.train.codegen import (
    ALWAYS,
    FOUND_INF,
    HOST,
    StepSpec,
    generate,
    make_step_function,
)
from ampgraph.train.loss_scale import DynamicLossScaleManager
from ampgraph.train.step_runtime import Counters, StepOutput, runtime_helpers

# -- generate: only the code a configuration needs -------------------------------------------


def test_the_plainest_step_has_no_scaling_clipping_accumulation_or_collectives():
    source = generate(StepSpec(title="O2 bf16"))
    assert '"""ampgraph train step: O2 bf16."""' in source
    for absent in ("manager", "clip_grad_norm_", "all_reduce", "micro", "no_sync", "monitor",
                   "observe_gradients", "update(optimizer)", "local_grads"):
        assert absent not in source, absent
    assert "scale = one" in source and "loss.backward()" in source
    assert "_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)" in source
    assert "host = to_host(info)" in source and "    if not host[0]:\n        optimizer.step()" \
        in source
    compile(source, "<check>", "exec")


@pytest.mark.parametrize("decision, present, absent", [
    (HOST, "if not host[0]:", "optimizer.found_inf"),
    (FOUND_INF, "optimizer.found_inf = found_inf", "to_host"),
    (ALWAYS, "optimizer.step()  # drop_overflow_update=False", "to_host"),
])
def test_the_optimizer_step_is_gated_as_decided(decision, present, absent):
    source = generate(StepSpec(title="t", scaled=True, decision=decision))
    assert present in source and absent not in source
    assert "(loss * scale).backward()" in source and "inv_scale = " in source


def test_every_option_adds_its_own_lines():
    spec = StepSpec(title="t", has_loss_fn=False, scaled=True, dynamic=True, clip_norm=0.5,
                    norm_type=1.0, distributed=True, accumulation_steps=3, no_sync=True,
                    monitor=True, update=True)
    source = generate(spec)
    for present in ("fp32_loss(model_loss(net(*args, **kwargs)))", "(loss / 3 * scale).backward()",
                    "with net.no_sync() if micro != 2 else nullcontext():",
                    "dist.all_reduce(found_inf, op=dist.ReduceOp.MAX, group=group)",
                    "monitor.after_backward(", "clip_grad_norm_(params, 0.5, norm_type=1.0)",
                    "update(optimizer)", "manager.update_loss_scale(found_inf)",
                    "counters.micro = micro + 1"):
        assert present in source, present
    compile(source, "<check>", "exec")


def test_observing_on_a_synchronising_step_observes_clean_steps_only():
    source = generate(StepSpec(title="t", scaled=True, observe=True))
    assert source.count("to_host(info)") == 1  # the step's one synchronisation, before
    assert source.index("to_host(info)") < source.index("observe_gradients")
    assert "    if not host[0]:\n        manager.observe_gradients(params, found_inf)\n" \
        "        optimizer.step()" in source
    compile(source, "<check>", "exec")
    fused = generate(StepSpec(title="t", scaled=True, observe=True, decision=FOUND_INF))
    assert "    manager.observe_gradients(params, found_inf)  # on the device" in fused


def test_observing_with_clipping_compiles():
    compile(generate(StepSpec(title="t", scaled=True, observe=True, clip_norm=1.0)), "<check>",
            "exec")


def test_observing_with_clipping_observes_clean_steps_clips_every_step_and_gates_the_step():
    source = generate(StepSpec(title="t", scaled=True, observe=True, clip_norm=1.0))
    assert source.count("to_host(info)") == 1
    assert "    if not host[0]:\n        manager.observe_gradients(params, found_inf)\n" \
        "    grad_norm = clip_grad_norm_(params, 1.0, norm_type=2.0)\n" \
        "    if not host[0]:\n        optimizer.step()\n" in source


# What build_train_step puts in the generated step's namespace (ampgraph/train/step.py).
NAMESPACE = {*runtime_helpers(), "net", "module", "loss_fn", "optimizer", "manager", "params",
             "found_inf", "one", "counters", "group", "monitor", "StepOutput", "update",
             "released"}
FLAGS = [f.name for f in dataclasses.fields(StepSpec) if f.type in ("bool", bool)]


def invalid(spec_args: dict) -> bool:
    """The combinations StepSpec refuses (no build_train_step configuration gives them)."""
    return ((not spec_args["scaled"] and any(spec_args[f] for f in
                                             ("dynamic", "custom_unscale", "observe")))
            or (spec_args["no_sync"] and spec_args["accumulation_steps"] == 1)
            or (spec_args["update"] and spec_args["decision"] == FOUND_INF)
            or (spec_args["release"] and (
                spec_args["clip_norm"] is not None or spec_args["accumulation_steps"] > 1
                or any(spec_args[f] for f in ("scaled", "monitor", "distributed", "sharded")))))


def unbound_names(source: str) -> set[str]:
    """Names the step reads that it neither assigns nor finds in its namespace or builtins
    (``symtable`` resolves each name's scope the way ``compile`` does)."""
    step = symtable.symtable(source, "<check>", "exec").get_children()[0]
    reads = {s.get_name() for s in step.get_symbols() if s.is_global() and s.is_referenced()}
    return reads - NAMESPACE - set(dir(builtins))


@pytest.mark.parametrize("clip_norm", [None, 1.0])
@pytest.mark.parametrize("accumulation_steps", [1, 2])
@pytest.mark.parametrize("decision", [HOST, FOUND_INF, ALWAYS])
def test_every_combination_of_flags_generates_a_well_formed_step(decision, accumulation_steps,
                                                                clip_norm):
    assert len(FLAGS) == 13  # a new flag joins the combinations
    seen: set[str] = set()
    for values in itertools.product((False, True), repeat=len(FLAGS)):
        args = dict(zip(FLAGS, values), decision=decision, clip_norm=clip_norm,
                    accumulation_steps=accumulation_steps)
        if invalid(args):
            with pytest.raises(ValueError):
                StepSpec(title="t", **args)
            continue
        source = generate(StepSpec(title="t", **args))
        if source in seen:  # a flag without effect here (cast_outputs without loss_fn ...)
            continue
        seen.add(source)
        where = f"{args}:\n{source}"
        compile(source, "<check>", "exec")  # no SyntaxError / IndentationError
        assert not unbound_names(source), where
        # release_grads: every parameter is stepped from its hook, in backward
        release = args["release"]
        steps = source.count("optimizer.step()") + source.count("update(optimizer)")
        assert steps == (not release), where
        assert ("released.stepping()" in source) == release, where
        gate = "if not host[0]:" in source
        assert gate == (decision == HOST and not release), where
        assert source.count("to_host(info)") == (decision == HOST and not release), where
        assert ("clip_grad_norm_" in source) == (clip_norm is not None), where
        assert source.rstrip().splitlines()[-1].startswith("    return StepOutput("), where
    assert seen


def test_unscaling_follows_the_gradients_layout():
    def unscale_line(**kw):
        source = generate(StepSpec(title="t", scaled=True, **kw))
        return [line.strip() for line in source.splitlines() if "unscale" in line
                and not line.strip().startswith("#")]

    assert unscale_line(custom_unscale=True) == ["manager.unscale_(params, found_inf)  # "
                                                 "per-layer scales"]
    assert unscale_line(multi_device=True) == ["unscale_by_device(params, found_inf, inv_scale)"]
    sharded = generate(StepSpec(title="t", scaled=True, sharded=True, clip_norm=1.0))
    assert "grads = local_grads(params)" in sharded and "full_tensor(grad_norm)" in sharded


@pytest.mark.parametrize("kwargs, match", [
    ({"decision": "sometimes"}, "decision must be"),
    ({"accumulation_steps": 0}, "accumulation_steps must be at least 1"),
    ({"observe": True}, "observe come from a loss-scale manager"),
    ({"dynamic": True, "custom_unscale": True}, "dynamic, custom_unscale come from"),
    ({"no_sync": True}, "needs accumulation_steps > 1"),
    ({"scaled": True, "update": True, "decision": FOUND_INF}, "decides on the host"),
])
def test_spec_refuses_what_no_configuration_gives(kwargs, match):
    with pytest.raises(ValueError, match=match):
        StepSpec(title="t", **kwargs)


def test_spec_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        StepSpec(title="t").scaled = True


# -- the generated function, run -------------------------------------------------------------


def namespace(model: nn.Module, opt, manager=None) -> dict:
    params = list(model.parameters())
    return {**runtime_helpers(), "net": model, "module": model, "optimizer": opt,
            "loss_fn": nn.functional.mse_loss, "manager": manager, "params": params,
            "found_inf": torch.zeros(()), "one": torch.ones(()), "counters": Counters(),
            "StepOutput": StepOutput, "group": None, "monitor": None}


def test_a_scaled_step_with_accumulation_runs_and_skips_on_overflow():
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    manager = DynamicLossScaleManager(init_loss_scale=8.0)
    spec = StepSpec(title="t", scaled=True, dynamic=True, accumulation_steps=2)
    step = make_step_function(generate(spec), namespace(model, opt, manager))
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    before = model.weight.detach().clone()
    first = step(x, y)
    assert not first.stepped and torch.equal(model.weight, before)
    out = step(x, y)
    assert out.stepped and out.loss_scale == 8.0 and out.overflow is False
    assert not torch.equal(model.weight, before)
    assert model.weight.grad.abs().max() < 10  # unscaled: of the order of the loss's
    after = model.weight.detach().clone()
    step(x, y)
    bad = step(x * float("inf"), y)
    assert bad.overflow is True and torch.equal(model.weight, after)
    assert manager.get_loss_scale() == 4.0


def test_the_generated_source_shows_in_tracebacks():
    step = make_step_function(generate(StepSpec(title="t")), {"params": [],
                                                              "found_inf": None})
    with pytest.raises(AttributeError) as info:
        step()
    frame = traceback.extract_tb(info.value.__traceback__)[-1]
    assert frame.filename.startswith("<ampgraph-train-step-") and frame.line == \
        "found_inf.zero_()"
    assert linecache.getline(frame.filename, 1).startswith("def train_step(")
