"""Faithfulness: randomness under the user's seed. ampgraph's CPU dropout draws its mask its
own way (runtime/cpu/dropout.py: the same keep probability, reproducible under
``torch.manual_seed``, not aten's positions), so what is compared is what a user relies
on: the same seed gives the same result, another seed another, the rate is the rate."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.ampgraph.faithfulness.harness import MLP, Case, check, compiled_whole, inputs


class Noisy(MLP):
    """Reparametrised noise (a VAE's sample, NEFTune's embedding noise) and dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        h = self.a(x)
        h = h + 0.1 * torch.randn_like(h)
        return self.b(self.drop(self.act(h)))


def seeded(call, model):
    model.train()
    x = inputs(n=512)
    with torch.no_grad():
        torch.manual_seed(11)
        a = call(x)
        torch.manual_seed(11)
        b = call(x)
        c = call(x)
        model.eval()
        torch.manual_seed(12)  # the noise of randn_like, not dropout's (off in eval)
        plain = call(x)
    return [torch.equal(a, b), torch.equal(a, c), plain,
            round(a.std().item() / plain.std().item(), 1)]


def dropout_rate(call, model):
    model.train()
    x = inputs(n=1024)
    with torch.no_grad():
        torch.manual_seed(3)
        h = model.act(model.a(x))
        kept = model.drop(h) != 0
    return [round(1 - kept.float().mean().item(), 2)]


def generator_state(call, model):
    """What the user draws after a call is reproducible under their seed (capture itself
    draws nothing: the first call, which captures, leaves the generator where the second
    does). Not eager's numbers: the dropout mask takes half the draws."""
    model.train()
    after = []
    for _ in range(2):
        torch.manual_seed(5)
        call(inputs(n=64))
        after.append(torch.rand(3))
    return [torch.equal(*after)]


CASES = [
    Case("dropout and randn_like under a user's seed", Noisy, seeded, after=compiled_whole),
    Case("the generator after a call", Noisy, generator_state),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_rng(case):
    check(case)


def test_the_compiled_dropout_keeps_its_rate():
    import ampgraph

    model = nn.Sequential(nn.Linear(64, 256), nn.Dropout(0.25)).train()
    net = ampgraph.compile(model, "O2", "bf16")
    with torch.no_grad():
        torch.manual_seed(0)
        out = net(torch.randn(512, 64))
    assert abs((out == 0).float().mean().item() - 0.25) < 0.01
