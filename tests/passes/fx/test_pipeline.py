"""passes/fx/pipeline.py: the whole FX pipeline, its pass manager and its collector pause."""

from __future__ import annotations

import gc
import warnings

import pytest
import torch
from torch import nn

from passes.fx.pipeline import gc_paused, run_amp_passes
from passes.policy import make_policy
from tests.helpers import make
from tests.passes.fx.helpers import check_pass


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
