"""ampgraph/train/loss_scale/base.py: the manager interface's defaults, the overflow flag
and the per-device unscale."""

from __future__ import annotations

import pytest
import torch

from ampgraph.train.loss_scale.base import LossScaleManager, overflow_flag, unscale_by_device


@pytest.mark.parametrize("flag, expected", [
    (True, 1.0), (False, 0.0), (1, 1.0), (0, 0.0),
    (torch.tensor(True), 1.0), (torch.tensor([0]), 0.0), (torch.tensor(3), 1.0),
    (torch.tensor(2, dtype=torch.int32), 1.0), (torch.tensor(0.25, dtype=torch.float64), 1.0),
    (torch.tensor(float("inf")), float("inf")), (torch.tensor(0.5), 0.5),  # fp32: as it is
])
def test_overflow_flag_is_a_0_dim_fp32_tensor_on_the_like_s_device(flag, expected):
    out = overflow_flag(flag, torch.zeros(()))
    assert out.shape == () and out.dtype == torch.float32 and out.device.type == "cpu"
    assert out.item() == expected


def test_overflow_flag_refuses_what_is_not_a_flag():
    with pytest.raises(ValueError, match=r"one-element tensor, got shape \(2,\)"):
        overflow_flag(torch.zeros(2), torch.zeros(()))
    with pytest.raises(ValueError, match="got str"):
        overflow_flag("yes", torch.zeros(()))


def test_unscale_by_device_divides_every_gradient_and_ors_the_flag():
    a, b, none = (torch.nn.Parameter(torch.ones(3)) for _ in range(3))
    a.grad = torch.full((3,), 8.0)
    b.grad = torch.tensor([2.0, float("inf"), 4.0])
    flag = torch.zeros(())
    unscale_by_device([a, none], flag, torch.tensor(0.5))
    assert a.grad.tolist() == [4.0, 4.0, 4.0] and flag.item() == 0.0 and none.grad is None
    unscale_by_device([b], flag, torch.tensor(0.5))
    assert flag.item() == 1.0
    unscale_by_device([a], flag, torch.tensor(1.0))
    assert flag.item() == 1.0, "a clean device does not clear another's overflow"


class Halving(LossScaleManager):
    """The smallest manager: only the abstract update."""

    def update_loss_scale(self, overflow):
        if bool(overflow_flag(overflow, self.scale)):
            self.scale.mul_(0.5)


def test_the_base_gives_the_defaults_a_subclass_relies_on():
    m = Halving(16.0)
    assert m.get_loss_scale() == 16.0 and m.scale.dtype == torch.float32
    assert m.get_drop_overflow_update() is True and m.dynamic is False
    assert not m.wants_gradients and not m.custom_unscale
    m.instrument(torch.nn.Linear(1, 1))
    m.observe_gradients([], torch.zeros(()))
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), 16.0)
    flag = torch.zeros(())
    m.unscale_([p], flag)
    assert p.grad.tolist() == [1.0, 1.0] and flag.item() == 0.0
    m.update_loss_scale(True)
    assert m.get_loss_scale() == 8.0
    assert m.to("cpu") is m and m.scale.device.type == "cpu"


def test_the_base_leaves_update_and_state_to_subclasses():
    m = LossScaleManager(2.0)
    for call in (lambda: m.update_loss_scale(False), m.state_dict,
                 lambda: m.load_state_dict({})):
        with pytest.raises(NotImplementedError):
            call()


def test_check_keys_names_the_manager_and_the_missing_keys():
    m = Halving(1.0)
    with pytest.raises(ValueError, match="Halving.load_state_dict expects a dict"):
        m._check_keys([("loss_scale", 1.0)], ("loss_scale",))
    with pytest.raises(ValueError, match=r"Halving.load_state_dict: missing keys \['b'\]"):
        m._check_keys({"a": 1}, ("a", "b"))
    m._check_keys({"a": 1, "b": 2}, ("a", "b"))
