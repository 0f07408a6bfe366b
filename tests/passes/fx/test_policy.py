"""passes/fx/policy.py: the FX op groups are data; lookups and fixed slots."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from passes.fx.policy import FX_GROUPS, FX_TABLE, fixed_slots, make_policy
from passes.policy import ALLOW, CLEAR, DENY, FP32, FP32_ONLY, INFER, LOW


@pytest.mark.parametrize("key, cls", [
    ("aten.linear", ALLOW), ("aten.conv2d.default", ALLOW), ("aten.softmax.int", DENY),
    ("aten.layer_norm", DENY), ("aten.view.default", CLEAR), ("aten.relu_", CLEAR),
    ("aten.gelu", INFER), ("aten.some_new_op", INFER), ("aten.sum.dim_IntList", DENY),
    ("aten.scaled_dot_product_attention", ALLOW), ("getitem", CLEAR),
    ("aten.linalg_multi_dot.default", ALLOW), ("aten.linalg_vecdot.default", ALLOW),
])
def test_lookup(key, cls):
    assert FX_TABLE.info(key).cls == cls


def test_every_group_has_a_reason_and_a_known_class():
    for g in FX_GROUPS:
        assert g.reason and g.cls in (ALLOW, INFER, DENY, CLEAR) and g.ops


def test_batch_norm_statistics_are_fixed_slots():
    assert fixed_slots("aten.batch_norm.default") == (1, 2, 3, 4)
    assert fixed_slots("aten.linear") == ()



def test_make_policy_uses_the_fx_table():
    p = make_policy("O2", deny_ops=["aten.gelu"])
    assert p.table is FX_TABLE and p.level == "O2"
    assert p.op_info("aten.softmax.int").cls == DENY and p.op_info("aten.gelu").cls == DENY
    assert p.op_info("Softmax").cls == INFER  # an ONNX key means nothing here


@pytest.mark.parametrize("key", ["aten.view_as_complex.default", "aten.fft_fft.default",
                                 "aten.fft_rfft", "aten._fft_r2c", "aten.stft"])
def test_ops_with_no_16_bit_kernels_are_fp32_at_every_level_but_o0(key):
    for level in ("O1", "O2", "O3"):
        policy = make_policy(level)
        info = policy.op_info(key)
        assert (info.cls, info.group, policy.base(info)) == (DENY, FP32_ONLY, FP32)
    assert make_policy("O3").base(make_policy("O3").op_info("aten.softmax.int")) == LOW


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_torch_autocasts_lower_precision_products_are_on_the_allow_list(level):
    """linalg.vecdot and linalg.multi_dot run in 16 bits under torch.autocast (its CPU and
    CUDA lists): on graph inputs, parameters and buffers alike."""
    class Products(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 16))
            self.register_buffer("m", torch.randn(16, 16))

        def forward(self, x, y):
            return (torch.linalg.vecdot(x, y)[:, None] + torch.linalg.vecdot(x, self.w)[:, None]
                    + torch.linalg.multi_dot([x, self.m, y.T]))

    x, y = torch.randn(4, 16), torch.randn(4, 16)
    with torch.autocast("cpu", torch.bfloat16):
        assert torch.linalg.vecdot(x, y).dtype == torch.bfloat16
    net = ampgraph.compile(Products(), amp_level=level, dtype="bf16")
    rows = {n["name"]: n for n in ampgraph.explain(net, x, y).nodes}
    products = [r for name, r in rows.items() if name.startswith("linalg_")]
    assert len(products) == 3
    assert all(r["precision"] == "bf16" and r["reason"].startswith("allow list")
               for r in products), products
