"""A model, runtime callables that record their calls, and the pipeline run shared by the
routing tests."""

from __future__ import annotations

import torch
from torch import nn

from passes.fx.pipeline import run_amp_passes
from passes.fx.policy import make_policy
from passes.fx.runtime_ops import RuntimeOps

aten = torch.ops.aten


CALLS: list[str] = []


def cached_cast(param, dtype):
    CALLS.append("cast")
    return param.to(dtype)


def amp_linear(x, w, b=None):
    CALLS.append("linear")
    return aten.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def amp_attention(*args, **kwargs):
    CALLS.append("attention")
    return aten.scaled_dot_product_attention(*args, **kwargs)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8, bias=False)
        self.out = nn.Linear(8, 3)

    def forward(self, ids):
        h = self.emb(ids)
        q, k = self.q(h).unsqueeze(1), self.k(h).unsqueeze(1)
        a = nn.functional.scaled_dot_product_attention(q, k, k).squeeze(1)
        return self.out(a + h).sum(1)


def rewritten(model, ids, low, level="O2", keep_io_types=True, **routes):
    gm = torch.export.export(model, (ids,), strict=False).module()
    result = run_amp_passes(gm, make_policy(level), low, keep_io_types=keep_io_types,
                            runtime=RuntimeOps(**routes))
    return gm, result


ROUTES = dict(weight_cast=cached_cast, linear=amp_linear, attention=amp_attention)
