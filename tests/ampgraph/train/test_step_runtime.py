"""ampgraph/train/step_runtime.py: the StepOutput a step returns, its counters, and the
helpers the generated code calls."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from ampgraph.train.codegen import StepSpec, generate
from ampgraph.train.loss_scale import unscale_by_device
from ampgraph.train.step_runtime import (
    Counters,
    StepOutput,
    cast_fp32,
    fp32_loss,
    full_tensor,
    local_grads,
    model_loss,
    runtime_helpers,
    to_host,
    zero_grads,
)

# -- StepOutput and Counters -------------------------------------------------------------------


def test_step_output_fetches_its_info_once_and_unpacks():
    info = torch.tensor([1.0, 512.0])
    out = StepOutput(torch.tensor(0.25), info, True)
    info.fill_(0.0)  # read lazily: the first read fetches what the tensor holds then
    assert (out.overflow, out.loss_scale) == (False, 0.0)
    info.fill_(7.0)
    assert out.loss_scale == 0.0  # fetched once
    loss, overflow, scale = StepOutput(torch.tensor(0.5), torch.tensor([1.0, 8.0]), False)
    assert (loss.item(), overflow, scale) == (0.5, True, 8.0)
    synced = StepOutput(torch.tensor(0.5), torch.tensor([0.0, 0.0]), True, host=[1.0, 2.0])
    assert synced.overflow is True and synced.loss_scale == 2.0 and synced.grad_norm is None
    assert repr(synced) == "StepOutput(loss=0.5, overflow=True, loss_scale=2.0, stepped=True)"


def test_counters_start_at_zero():
    c = Counters()
    assert (c.micro, c.step_index) == (0, 0)
    with pytest.raises(AttributeError):
        c.other = 1  # slots


# -- helpers the generated code calls --------------------------------------------------------


def test_fp32_loss_takes_one_element_and_widens_it():
    got = fp32_loss(torch.tensor([[2.0]], dtype=torch.bfloat16))
    assert got.dtype == torch.float32 and got.shape == () and got.item() == 2.0
    scalar = torch.tensor(1.5)
    assert fp32_loss(scalar) is scalar
    for bad, shown in [(torch.ones(3), "(3,)"), (1.0, "float")]:
        with pytest.raises(ValueError, match=rf"one-element tensor, got {re.escape(shown)}: "):
            fp32_loss(bad)


def test_model_loss_finds_the_loss_in_what_the_model_returns():
    t = torch.tensor(1.0)
    assert model_loss(t) is t
    assert model_loss({"loss": t, "logits": None}) is t
    assert model_loss(type("Out", (), {"loss": t})()) is t
    with pytest.raises(ValueError, match="pass labels=.*got dict"):
        model_loss({"logits": t})


def test_cast_fp32_makes_every_floating_output_fp32():
    out = cast_fp32({"a": torch.ones(2, dtype=torch.bfloat16),
                     "ids": torch.ones(2, dtype=torch.long),
                     "b": [torch.ones(1, dtype=torch.float64)], "n": 3})
    assert out["a"].dtype == torch.float32 and out["ids"].dtype == torch.long
    assert out["b"][0].dtype == torch.float32 and out["n"] == 3


def test_grads_and_tensors_of_plain_parameters_pass_through():
    p, q = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    p.grad = torch.full((2,), 3.0)
    assert local_grads([p, q]) == [p.grad] and local_grads([p])[0] is p.grad
    t = torch.ones(1)
    assert full_tensor(t) is t
    assert to_host(torch.tensor([0.0, 4.0])) == [0.0, 4.0]


def test_runtime_helpers_names_what_the_source_uses():
    helpers = runtime_helpers()
    assert helpers["unscale_by_device"] is unscale_by_device and helpers["torch"] is torch
    assert helpers["clip_grad_norm_"] is torch.nn.utils.clip_grad_norm_
    source = generate(StepSpec(title="t", clip_norm=1.0, multi_device=True, no_sync=True,
                               accumulation_steps=2))
    for name in ("clip_grad_norm_", "unscale_by_device", "nullcontext", "fp32_loss", "to_host"):
        assert name in source and name in helpers


def test_zero_grads_zeroes_existing_gradients_in_place_and_skips_missing_ones():
    p, q = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    p.grad = grad = torch.full((2,), 3.0)
    zero_grads([p, q])
    assert p.grad is grad and p.grad.tolist() == [0.0, 0.0] and q.grad is None
