"""ampgraph/train/loss_scale/fixed.py: a constant scale, MindSpore's defaults, state."""

from __future__ import annotations

import pytest
import torch

from ampgraph.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager


def test_defaults_are_mindspore_s():
    fixed = FixedLossScaleManager()
    assert fixed.get_loss_scale() == 128.0 and fixed.get_drop_overflow_update() is True


def test_fixed_manager_never_changes():
    m = FixedLossScaleManager(loss_scale=1024, drop_overflow_update=False)
    for flag in (True, False, torch.tensor(1.0)):
        m.update_loss_scale(flag)
    assert m.get_loss_scale() == 1024.0 and m.get_drop_overflow_update() is False


def test_fixed_state_dict_round_trip_and_wrong_type():
    saved = FixedLossScaleManager(16, drop_overflow_update=False).state_dict()
    m = FixedLossScaleManager()
    m.load_state_dict(saved)
    assert m.get_loss_scale() == 16.0 and m.drop_overflow_update is False
    with pytest.raises(ValueError, match="missing keys"):
        DynamicLossScaleManager().load_state_dict(saved)
    bad = {**DynamicLossScaleManager().state_dict(), "scale_window": 0}
    with pytest.raises(ValueError, match="scale_window"):
        DynamicLossScaleManager().load_state_dict(bad)


def test_repr_names_the_state():
    assert "loss_scale=128.0" in repr(FixedLossScaleManager())
