"""Models and the pipeline run shared by the fusion tests."""

from __future__ import annotations

import torch
from torch import nn

from passes.fx.pipeline import run_amp_passes
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps

aten = torch.ops.aten


class ConvBlock(nn.Module):
    """conv -> BN -> relu -> conv -> BN, + residual, relu: the ResNet pattern."""

    def __init__(self, out_fp32: bool = False):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2, self.bn2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.out_fp32 = out_fp32

    def forward(self, x):
        h = self.conv2(torch.relu(self.bn1(self.conv1(x))))
        if self.out_fp32:  # the norm's output is the model's output: nothing to fuse
            return self.bn2(h)
        return torch.relu(self.bn2(h) + h)


class LnBlock(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.fc1, self.ln, self.fc2 = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, d)
        self.gn = nn.GroupNorm(2, 4)

    def forward(self, x):
        return self.fc2(self.ln(self.fc1(x)))


def passes(model, inputs, fuse, level="O2", low=torch.bfloat16, runtime=None):
    """``model`` exported and rewritten, every fusion on or off (``fuse``); attention on
    repeated key/value heads grouped where ``fuse``, unless ``runtime`` says otherwise."""
    gm = torch.export.export(model, inputs, strict=False).module()
    run_amp_passes(gm, make_policy(level), low, fuse_norm_casts=fuse,
                   channels_last_inputs=fuse, sink_gather_casts=fuse,
                   runtime=runtime or RuntimeOps(unrepeated_kv_heads=fuse))
    return gm


def norm_nodes(gm):
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and n.target in (aten.batch_norm.default,
                                                        aten.layer_norm.default)]
