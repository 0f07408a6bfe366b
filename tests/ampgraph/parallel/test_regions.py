"""Regional compilation: which modules are blocks, and the model compiled in place module by
module computing what the whole-model compile computes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.config import AmpConfig
from ampgraph.module import AmpModule
from ampgraph.parallel.regions import compile_regions, find_blocks
from ampgraph.report import GLUE, UNCOMPILED
from tests.ampgraph.parallel.helpers import Block, batch, lm_loss, make_model


def _config(**kwargs):
    return AmpConfig.create(dtype="bf16", **kwargs).resolve(torch.device("cpu"))


def test_blocks_default_to_a_module_lists_items():
    assert find_blocks(make_model()) == ["layers.0", "layers.1"]


def test_blocks_default_to_hf_no_split_modules():
    model = make_model()
    model._no_split_modules = ["LayerNorm"]  # as an HF PreTrainedModel declares its blocks
    assert find_blocks(model) == ["layers.0.norm", "layers.1.norm", "norm"]


@pytest.mark.parametrize("blocks", [[Block], ["Block"], ["layers.*"]])
def test_blocks_named_by_class_class_name_or_path(blocks):
    assert find_blocks(make_model(), blocks) == ["layers.0", "layers.1"]


def test_no_block_found_says_how_to_name_them():
    with pytest.raises(ValueError, match="blocks="):
        find_blocks(nn.Sequential(nn.Linear(2, 2)), ["decoder.*"])
    with pytest.raises(TypeError, match="module classes"):
        find_blocks(make_model(), [3])


def test_compiled_in_place_region_by_region_matches_the_whole_model(one_thread):
    x, y = batch(0, 4)
    whole = ampgraph.compile(make_model(), "O2", "bf16")
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    blocks = compile_regions(model, _config(), find_blocks(model))
    assert blocks == [model.layers[0], model.layers[1]]
    assert all(isinstance(m, AmpModule) for m in (model.embed, model.norm, model.head, *blocks))
    assert [n for n, _ in model.named_parameters()] == names  # the checkpoint's keys stay
    lm_loss(model(x), y).backward()
    lm_loss(whole(x), y).backward()
    for (name, p), q in zip(model.named_parameters(), whole.parameters()):
        cos = torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0)
        assert cos > 0.999, (name, cos)  # bf16 apart: the regions' edges stay fp32
    report = ampgraph.explain(model)
    assert [(e.path, e.reason) for e in report.eager] == [("<root>", GLUE)]
    assert {r["precision"] for r in report.nodes} >= {"bf16", "fp32"}


def test_module_paths_reach_overrides_and_explain_names_modules_left_fp32(one_thread):
    model = make_model()
    compile_regions(model, _config(module_overrides={"layers.1.*": "fp32"}), ["layers.1"])
    model.norm = nn.LayerNorm(model.norm.normalized_shape)  # state, left uncompiled
    report = ampgraph.explain(model, batch(0, 2)[0])
    linears = {r["module"]: r["precision"] for r in report.nodes if r["op"] == "aten.linear"}
    assert linears == {"layers.0.fc1": "bf16", "layers.0.fc2": "bf16", "layers.1.fc1": "fp32",
                       "layers.1.fc2": "fp32", "head": "bf16"}
    eager = {e.path: e.reason for e in report.eager}
    assert eager == {"<root>": GLUE, "norm": UNCOMPILED}


def test_blocks_checkpointed_before_compiling_stay_checkpointed(one_thread):
    """torchtitan's order: activation checkpointing per block, then compile and shard."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    x, y = batch(0, 4)
    plain, wrapped = make_model(), make_model()
    for i, block in enumerate(wrapped.layers):
        wrapped.layers[i] = checkpoint_wrapper(block)
    for model in (plain, wrapped):
        compile_regions(model, _config(), find_blocks(model))
        lm_loss(model(x), y).backward()
    for p, q in zip(plain.parameters(), wrapped.parameters()):
        assert torch.equal(p.grad, q.grad)
    rows = [r for r in ampgraph.explain(wrapped).nodes if r["op"] == "checkpoint"]
    assert len(rows) == 2  # one recomputed region per block
