"""What the CPU runtime's weight tests share: small models, graphs compiled with a
``WeightCache``'s casts, linears and embeddings (or without them), and the thresholds set
so that tiny weights take each path."""

from __future__ import annotations

import copy

import torch
from torch import nn

import ampgraph.runtime.cpu.blocked as blocked
import ampgraph.runtime.cpu.linear as linear
import ampgraph.runtime.cpu.weights as weights
from ampgraph.runtime.cpu.weights import WeightCache
from passes.fx import run_amp_passes
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps


class TiedHead(nn.Module):
    """Input and output embeddings sharing one table, as GPT-2's and BERT's do."""

    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.relu(self.fc(self.emb(ids))))


def tied_step(model: TiedHead, gm, plain, ids) -> None:
    """One training step of ``gm`` (compiled from ``model``) and of ``plain``: autograd sums
    the tied table's two gradient shares in place (no table-sized out-of-place add, under
    the profiler), into aten's gradient."""
    shape = list(model.emb.weight.shape)
    model.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    with torch.profiler.profile(record_shapes=True) as prof:
        gm(ids).float().square().sum().backward()
    adds = {e.key for e in prof.key_averages(group_by_input_shape=True)
            if e.key in ("aten::add", "aten::add_") and shape in e.input_shapes}
    assert adds == {"aten::add_"}
    plain(ids).float().square().sum().backward()
    ref = dict(plain.named_parameters())["emb.weight"].grad
    torch.testing.assert_close(model.emb.weight.grad, ref, rtol=0, atol=0)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = self.fc2(h) + self.fc2(h * 2)  # a weight used twice: one cast, two linears
        return self.fc3(torch.relu(h))


class Lookup(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.fc = nn.Embedding(50, 16, padding_idx=0), nn.Linear(16, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def compiled(model, x, fused):
    gm = torch.export.export(model, (x,), strict=False).module()
    cache = WeightCache()
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16, runtime=RuntimeOps(
        weight_cast=cache.cast, linear=cache.amp_linear if fused else None,
        embedding=cache.amp_embedding if fused else None))
    return gm, cache


def fused_and_plain(model, x):
    """``model`` compiled with the runtime's linears and embeddings, with its cache, and a
    deep copy compiled without them: (fused, cache, plain)."""
    fused, cache = compiled(model, x, True)
    plain, _ = compiled(copy.deepcopy(model), x, False)
    return fused, cache, plain


def blocks(monkeypatch, scratch, at=None):
    """Cast and compute weights of ``at`` (default: ``scratch``) elements or more block by
    block, ``scratch`` elements at a time."""
    monkeypatch.setattr(blocked, "SCRATCH_NUMEL", scratch)
    monkeypatch.setattr(linear, "BLOCKED_NUMEL", scratch if at is None else at)


def paths(monkeypatch, path):
    """Net's linears as ``path``: "aten" (small weights, by default: aten's linear on a fresh
    cast), "whole" (the fused linear on a whole working copy) or "blocked" (2-3 rows a
    block); returns the block size or None."""
    if path == "whole":
        monkeypatch.setattr(weights, "KEPT_COPY_BYTES", 0)
    if path == "blocked":
        blocks(monkeypatch, 40)
        return 40
    return None
