"""ampgraph/train/loss_scale/resolve.py: what ``loss_scale_manager="auto"`` means."""

from __future__ import annotations

import pytest
import torch

from ampgraph.train.adaptive_scale import AdaptiveLossScaleManager
from ampgraph.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager
from ampgraph.train.loss_scale.resolve import resolve_manager


def test_auto_is_a_fresh_dynamic_manager_for_fp16_and_none_otherwise():
    first = resolve_manager("auto", torch.float16)
    assert isinstance(first, DynamicLossScaleManager) and first.get_loss_scale() == 2.0**16
    assert resolve_manager("auto", torch.float16) is not first
    assert resolve_manager("auto", torch.bfloat16) is None
    assert resolve_manager("auto", torch.float32) is None  # O0


def test_an_explicit_manager_or_none_is_kept_as_given():
    for manager in (FixedLossScaleManager(4.0), DynamicLossScaleManager(),
                    AdaptiveLossScaleManager()):
        assert resolve_manager(manager, torch.float16) is manager
        assert resolve_manager(manager, torch.bfloat16) is manager
    assert resolve_manager(None, torch.float16) is None


@pytest.mark.parametrize("bad", ["dynamic", 128.0, DynamicLossScaleManager])
def test_anything_else_says_what_is_accepted(bad):
    with pytest.raises(ValueError, match="loss_scale_manager must be 'auto', None, or a"):
        resolve_manager(bad, torch.float16)
