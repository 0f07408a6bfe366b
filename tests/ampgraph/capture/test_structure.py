"""ampgraph/capture/structure.py: outputs of any structure are flattened and rebuilt."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import ampgraph


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    ids: torch.Tensor
    double: torch.Tensor
    name: str


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, ids, d):
        y = self.fc(x)
        return {"out": Out(y, ids + 1, d * 2, "tag"), "pair": (y.argmax(-1), y.sum())}


def test_dict_and_dataclass_outputs_int_and_fp64_untouched():
    model = Mixed()
    net = ampgraph.compile(model, "O3", "bf16")
    x, ids, d = torch.randn(2, 4), torch.arange(2), torch.randn(2, dtype=torch.float64)
    out = net(x, ids, d)
    assert isinstance(out["out"], Out) and out["out"].name == "tag"
    assert out["out"].logits.dtype == torch.float32
    assert out["out"].ids.dtype == torch.int64 and torch.equal(out["out"].ids, ids + 1)
    assert out["out"].double.dtype == torch.float64 and torch.equal(out["out"].double, d * 2)
    assert out["pair"][0].dtype == torch.int64


class OddOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return {"y": y, "batch": x.shape[0], "opaque": object() if x.dim() > 5 else None}


def test_symbolic_sizes_in_outputs_follow_the_input():
    net = ampgraph.compile(OddOutputs(), "O2", "bf16")
    assert net(torch.randn(3, 4))["batch"] == 3
    assert net(torch.randn(6, 4))["batch"] == 6


class Unrebuildable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        class Box:  # not a tensor, constant or pytree node
            pass

        box = Box()
        box.value = self.fc(x)
        return box


def test_unrebuildable_outputs_run_eagerly_instead_of_returning_stale_objects():
    model = Unrebuildable()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="cannot rebuild"):
        out = net(x)
    assert type(out).__name__ == "Box" and out.value.dtype == torch.float32
    torch.testing.assert_close(out.value, model.fc(x), rtol=2e-2, atol=2e-2)
