"""passes/fx/fold/identities.py: ops that return their input's values are skipped where
that shares no storage and keeps every dtype; the values and gradients stay."""

from __future__ import annotations

import torch
from torch import nn

import passes.fx.pipeline as pipeline
from passes._infra import PassResult
from passes.fx.fold.identities import skip_identity_ops
from passes.fx.policy import make_policy
from tests.passes.fx.helpers import export

aten = torch.ops.aten


class MaskAndAngles(nn.Module):
    """What transformers traces: ``and_masks`` from a True scalar, ``arange(n) + 0``
    positions, rotary angles times a scaling of 1; and near-identities that must stay."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, keep):
        n = x.shape[1]
        pos = torch.arange(n) + 0
        causal = pos[None, :] <= pos[:, None]
        mask = keep.new_ones((), dtype=torch.bool) & causal & keep.bool()[:, None, :]
        angles = torch.cos(pos.float()[:, None] * self.fc.bias) * 1.0
        h = self.fc(x)
        h = h * 1.0 + angles + h.relu()  # h is read twice: h * 1 stays
        kept = (h + 0) * (x.sum() * 1) * (x * 1)  # float + 0 and an input times 1 stay
        return torch.where(mask[..., None], kept[:, None], 0.0).sum(1), pos + 0.0


def test_identities_are_skipped_with_the_same_values_and_gradients():
    torch.manual_seed(0)
    x, keep = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    gm = export(MaskAndAngles(), (x, keep))
    before = {n.name: n.target for n in gm.graph.nodes}
    expected = gm(x, keep)
    assert skip_identity_ops(gm).modified
    gm.graph.eliminate_dead_code()
    gm.recompile()
    gone = {name for name in before if name not in {n.name for n in gm.graph.nodes}}
    targets = sorted(str(before[name]) for name in gone)
    assert targets == ["aten.__and__.Tensor", "aten.add.Tensor", "aten.mul.Tensor",
                       "aten.mul.Tensor", "aten.new_ones.default"], targets
    kept = {n.name: n for n in gm.graph.nodes if n.op == "call_function"}
    stay = [n for n in kept.values() if len(n.args) == 2 and n.args[1] in (0, 1)
            and n.target in (aten.mul.Tensor, aten.add.Tensor)]
    assert sorted((str(n.args[0]), n.args[1]) for n in stay) == [
        ("add_2", 0), ("arange", 0.0), ("linear", 1.0), ("x", 1)], \
        "float h + 0 (-0.0 + 0 is +0.0), int + 0.0, a twice-read value and an input stay"
    got = gm(x, keep)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_pipeline_skips_them_before_painting(monkeypatch):
    x, keep = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    gm = export(MaskAndAngles(), (x, keep))
    plain = export(MaskAndAngles(), (x, keep))
    plain.load_state_dict(gm.state_dict())
    pipeline.run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    monkeypatch.setattr(pipeline, "skip_identity_ops",
                        lambda g, recompile=True: PassResult(g, False))
    pipeline.run_amp_passes(plain, make_policy("O2"), torch.bfloat16)
    ops = lambda g: [n for n in g.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert len(ops(plain)) - len(ops(gm)) == 5
    assert not any(n.target is aten.new_ones.default for n in gm.graph.nodes)
    xs = [x.clone().requires_grad_() for _ in range(2)]
    outs = gm(xs[0], keep), plain(xs[1], keep)
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    outs[0][0].sum().backward()
    outs[1][0].sum().backward()
    assert torch.equal(xs[0].grad, xs[1].grad)
