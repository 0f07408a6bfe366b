"""passes/fx/pipeline.py: the whole FX pipeline, its pass manager and its collector pause."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

import passes.fx.pipeline as pipeline
from passes import PassError, PassResult
from passes._infra import visiting
from passes.fx.pipeline import gc_paused, run_amp_passes
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps
from tests.helpers import make
from tests.passes.fx.helpers import TwoConsumers, check_pass, export


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["lenet5", "resnet", "bert_encoder"])
def test_pipeline_on_reference_models(name, level, dtype):
    model, inputs = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_pass(model, inputs, level, dtype)


@pytest.mark.parametrize("enabled", [True, False])
def test_gc_paused_restores_the_collector_state(enabled):
    was = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert gc.isenabled() == enabled
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError("a failing pass")
        assert gc.isenabled() == enabled
    finally:
        (gc.enable if was else gc.disable)()


def test_run_amp_passes_leaves_the_collector_on():
    gm = torch.export.export(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), (torch.randn(2, 4),),
                             strict=False).module()
    assert gc.isenabled()
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    assert gc.isenabled()


EXPECTED_PASSES = [
    "prepare", "skip_whole_slices", "merge_duplicate_ops", "fuse_tanh_gelu", "skip_identity_ops",
    "drop_true_masks", "drop_unused_ops",
    "build_dataflow",
    "mark_range_hazards", "mark_written_views", "force_autocast_off", "mark_index_values",
    "mark_periodic_arguments",
    "paint",
    "annotate", "insert_casts",
    "fold_casts", "fold_constant_casts", "fuse_norm_casts", "channels_last_inputs",
    "sink_gather_casts",
    "group_kv_heads",
    "drop_dead_ops", "contiguous_linear_inputs", "verify",
    "count_casts", "route_weight_casts", "route_linears", "route_embeddings",
    "route_attention", "outline_checkpoints", "recompile",
]


def test_the_pipeline_is_a_list_of_named_passes():
    def fn(*args, **kwargs):
        return None

    everything = pipeline.amp_passes(
        make_policy("O2"), torch.bfloat16, pipeline.PipelineState(), runtime=RuntimeOps(
            weight_cast=fn, linear=fn, embedding=fn, attention=fn, unrepeated_kv_heads=True))
    assert [p.__name__ for p in everything] == EXPECTED_PASSES
    plain = pipeline.amp_passes(make_policy("O0"), torch.bfloat16, pipeline.PipelineState(),
                                fuse_norm_casts=False, channels_last_inputs=False,
                                sink_gather_casts=False, runtime=RuntimeOps())
    assert [p.__name__ for p in plain] == [
        "prepare", "skip_whole_slices", "merge_duplicate_ops", "drop_unused_ops", "build_dataflow",
        "paint",
        "annotate",
        "insert_casts", "fold_casts", "fold_constant_casts", "drop_dead_ops",
        "contiguous_linear_inputs", "verify",
        "count_casts", "outline_checkpoints", "recompile"]


def failing_route(gm, fn, low):
    """A route pass with a bug: a KeyError at the first low-precision op."""
    for node in visiting(gm.graph.nodes):
        if node.meta.get("amp_precision") == "low":
            node.meta["no such key"]
    return PassResult(gm, False)


def test_a_failing_pass_in_the_real_pipeline_is_named_with_its_node(monkeypatch):
    monkeypatch.setattr(pipeline, "route_attention", failing_route)
    gm = export(TwoConsumers(), (torch.randn(2, 4),))
    with pytest.raises(PassError) as info:
        run_amp_passes(gm, make_policy("O2"), torch.bfloat16,
                       runtime=RuntimeOps(attention=torch.add))
    first_low = next(n.name for n in gm.graph.nodes if n.meta.get("amp_precision") == "low")
    assert info.value.pass_name == "route_attention"
    assert info.value.node == first_low
    assert "KeyError: 'no such key'" in str(info.value)
    assert isinstance(info.value.__cause__, KeyError)
    assert gc.isenabled()


def test_a_failing_pass_makes_compile_fall_back_with_a_message_naming_it(monkeypatch):
    import ampgraph

    monkeypatch.setattr(pipeline, "route_attention", failing_route)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match=r"ampgraph pass failed: PassError: "
                                         r"\[route_attention\] at node 'linear"):
        out = ampgraph.compile(model, "O2", "bf16")(x)
    torch.testing.assert_close(out, model(x))  # its own code ran eagerly in fp32


def test_pass_errors_of_the_passes_pass_through_the_pipeline(monkeypatch):
    def verify(gm, low):
        raise PassError("verify", "mul", "input 0 (x) is bf16, but the node needs fp32")

    monkeypatch.setattr(pipeline, "verify", verify)
    with pytest.raises(PassError) as info:
        run_amp_passes(export(TwoConsumers(), (torch.randn(2, 4),)), make_policy("O2"),
                       torch.bfloat16)
    assert (info.value.pass_name, info.value.node) == ("verify", "mul")
    assert info.value.__cause__ is None


def test_a_failure_inside_a_real_pass_names_the_node_its_visiting_loop_is_at(monkeypatch):
    """The passes walk their nodes through ``passes._infra.visiting``: a helper that fails
    (here fold_casts' dtype lookup, with a ``node`` local of its own naming another node)
    is reported at the cast fold_casts was at: the first one."""
    import passes.fx.fold.casts as casts

    def dtype_of(value):
        node = value.graph.output_node()  # noqa: F841 - a misleading local called node
        raise KeyError("no dtype")

    monkeypatch.setattr(casts, "dtype_of", dtype_of)
    gm = export(TwoConsumers(), (torch.randn(2, 4),))
    with pytest.raises(PassError) as info:
        run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    first_cast = next(n.name for n in gm.graph.nodes if n.meta.get("amp_cast"))
    assert (info.value.pass_name, info.value.node) == ("fold_casts", first_cast)
    assert str(info.value).endswith("KeyError: 'no dtype'")
