"""ampgraph/integrations/_scaling.py: LossScaler, the fp16 loss scaling the trainer
integrations cut at scale / unscale_ / update."""

from __future__ import annotations

import torch

from ampgraph.integrations._scaling import LossScaler
from ampgraph.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager


def params_with_grads(*grads: list[float]) -> list[torch.nn.Parameter]:
    out = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros(len(g)))
        p.grad = torch.tensor(g)
        out.append(p)
    return out


def test_scale_multiplies_the_loss_and_its_gradient():
    scaler = LossScaler(FixedLossScaleManager(8.0))
    w = torch.tensor(3.0, requires_grad=True)
    scaled = scaler.scale(w * 2)
    assert scaled.item() == 48.0
    scaled.backward()
    assert w.grad.item() == 16.0
    assert scaler.get_loss_scale() == 8.0


def test_scale_grad_keeps_the_loss_and_scales_only_its_gradient():
    scaler = LossScaler(FixedLossScaleManager(8.0))
    w = torch.tensor(3.0, requires_grad=True)
    loss = scaler.scale_grad(w * 2)
    assert loss.item() == 6.0  # what the trainer logs: the unscaled loss
    loss.backward()
    assert w.grad.item() == 16.0


def test_unscale_divides_the_gradients_and_reports_no_overflow():
    scaler = LossScaler(DynamicLossScaleManager(init_loss_scale=4.0))
    params = params_with_grads([4.0, 8.0], [2.0])
    params.append(torch.nn.Parameter(torch.ones(1)))  # no gradient: skipped
    scaler.scale(torch.tensor(1.0))
    assert scaler.unscale_(params) is False
    assert params[0].grad.tolist() == [1.0, 2.0] and params[1].grad.tolist() == [0.5]
    scaler.update()
    assert scaler.get_loss_scale() == 4.0  # a clean step: no backoff (window not reached)


def test_a_non_finite_gradient_or_loss_is_an_overflow_and_the_scale_backs_off():
    manager = DynamicLossScaleManager(init_loss_scale=4.0)
    scaler = LossScaler(manager)
    scaler.scale(torch.tensor(1.0))
    assert scaler.unscale_(params_with_grads([1.0, float("inf")])) is True
    scaler.update()
    assert manager.get_loss_scale() == 2.0
    # the flag was cleared by update: the next clean step is clean
    scaler.scale(torch.tensor(1.0))
    assert scaler.unscale_(params_with_grads([1.0])) is False
    # a non-finite loss with finite gradients still counts
    scaler.scale_grad(torch.tensor(float("nan")))
    assert scaler.unscale_(params_with_grads([1.0])) is True
    scaler.update()
    assert manager.get_loss_scale() == 1.0


def test_update_before_any_scaling_does_nothing():
    manager = DynamicLossScaleManager(init_loss_scale=4.0, scale_window=1)
    LossScaler(manager).update()
    assert manager.get_loss_scale() == 4.0 and int(manager.growth_tracker) == 0
