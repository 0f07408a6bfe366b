"""passes/fx/grad_scale.py: regions, inserted edges, idempotence, and the gradients they scale."""

from __future__ import annotations

import torch
from torch import nn

from ampgraph.runtime.grad_scale import GradScaleEdge
from passes.fx.grad_scale import GRAD_SCALE_META, insert_grad_scales, node_regions


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        self.t = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.b(self.a(x)) * self.t


def _gm():
    torch.manual_seed(0)
    net = Net()
    return net, torch.export.export(net, (torch.randn(3, 4),), strict=False).module()


LAYERS = {"a": 1, "b.0": 2, "b.2": 3}


def test_regions_follow_layers_and_parameter_free_ops_inherit():
    _, gm = _gm()
    region, grad = node_regions(gm, LAYERS)
    by_name = {n.name: r for n, r in region.items()}
    relu = next(n for n in region if n.target is torch.ops.aten.relu.default)
    assert region[relu] == 2  # between b.0 and b.2: stays in b.0's region
    mul = next(n for n in region if n.target is torch.ops.aten.mul.Tensor)
    assert region[mul] == 0 and grad[mul]
    assert all(r == 0 for name, r in by_name.items() if name.startswith("x"))


def test_edges_structure_idempotence_and_gradients():
    net, gm = _gm()
    scales = torch.tensor([1.0, 2.0**10, 2.0**-6, 2.0**20])
    x = torch.randn(3, 4)
    expected_out = gm(x)
    result = insert_grad_scales(gm, LAYERS, lambda s, d: GradScaleEdge(scales, s, d).apply)
    assert result.modified
    edges = sorted(n.meta[GRAD_SCALE_META] for n in gm.graph.nodes if GRAD_SCALE_META in n.meta)
    assert edges == [(1, 2), (2, 3), (3, 0)]
    gm.graph.lint()
    assert not insert_grad_scales(gm, LAYERS, lambda s, d: None).modified
    out = gm(x)
    torch.testing.assert_close(out, expected_out, rtol=0, atol=0)
    out.sum().backward()
    ref = Net()
    ref.load_state_dict(net.state_dict())
    ref(x).sum().backward()
    for name, p in net.named_parameters():  # each layer's grads come out at its own scale
        layer = name.rpartition(".")[0]
        factor = scales[LAYERS.get(layer, 0)]
        torch.testing.assert_close(p.grad, dict(ref.named_parameters())[name].grad * factor)
