"""Graphs and checks shared by the FX pass tests."""

from __future__ import annotations

import collections

import torch
from torch import fx, nn
from torch.fx.experimental.proxy_tensor import make_fx

from passes.fx import run_amp_passes, verify
from passes.fx.dtypes import is_amp_cast
from passes.fx.fold.cast_count import count_casts
from passes.fx.policy import make_policy
from tests.helpers import cosine, first_tensor


def export(model, inputs):
    return torch.export.export(model, inputs, strict=False).module()


def check_pass(model, inputs, level, dtype):
    """Structure, invariants and numerics of the FX pipeline on one model."""
    model.eval()
    with torch.no_grad():
        expected = first_tensor(model(*inputs))
    gm = export(model, inputs)
    result = run_amp_passes(gm, make_policy(level), dtype)
    casts = [n for n in gm.graph.nodes if is_amp_cast(n)]
    # structure: one cast per (producer, dtype); parameter casts hoisted; counts agree
    keys = collections.Counter((n.args[0], n.kwargs["dtype"]) for n in casts)
    assert all(v == 1 for v in keys.values()), keys
    assert result.casts == len(casts) == count_casts(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_op = min((order[n] for n in gm.graph.nodes
                    if n.op == "call_function" and not is_amp_cast(n)), default=0)
    for c in casts:
        if c.args[0].op == "get_attr":
            assert order[c] < first_op, f"{c} not hoisted"
        src = c.args[0]
        if is_amp_cast(src):  # only fp32 -> low -> fp32 may chain (it changes values)
            assert src.args[0].meta["val"].dtype == torch.float32
    if level == "O0":
        assert not casts
    # invariants: lint, verify, idempotence
    gm.graph.lint()
    verify(gm, dtype)
    again = run_amp_passes(gm, make_policy(level), dtype)
    assert again.casts == result.casts, "a second run must add no casts"
    # numerics
    with torch.no_grad():
        got = first_tensor(gm(*inputs))
    assert got.dtype == torch.float32
    tol = 0.999 if level != "O0" else 1.0 - 1e-6
    assert cosine(got, expected) >= tol
    return gm, result


class TwoConsumers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + self.b(h * 2), self.norm(h)


D = 8


def blocks(n: int) -> fx.GraphModule:
    """n blocks of linear -> gelu -> layer_norm -> softmax mix (native_layer_norm: 3 outputs)."""

    def f(x, w, b, g):
        for _ in range(n):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
            h = torch.nn.functional.layer_norm(h, (D,), g)
            x = x + h * torch.softmax(h, -1)
        return x

    args = (torch.randn(2, D), torch.randn(D, D), torch.randn(D), torch.randn(D))
    return make_fx(f, tracing_mode="fake")(*args)


def dtype_blocks(n: int, fp64: bool = True) -> fx.GraphModule:
    """:func:`blocks` plus ops that name a dtype and, with ``fp64``, an fp64 side path: a
    captured graph with two float dtypes (the general "follows its inputs" rule) or one
    (the single-dtype shortcut)."""

    def f(x, w, b, g, e):
        for _ in range(n):
            h = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, b))
            h = torch.nn.functional.layer_norm(h, (D,), g)
            side = (h.to(e.dtype) * e).sum(-1, keepdim=True).to(torch.float32)
            total = h.sum(-1, keepdim=True, dtype=torch.float32)  # names its dtype
            x = x + h * torch.softmax(h, -1) + side + total
        return x

    args = (torch.randn(2, D), torch.randn(D, D), torch.randn(D), torch.randn(D),
            torch.randn(D, dtype=torch.float64 if fp64 else torch.float32))
    return make_fx(f, tracing_mode="fake")(*args)


def one_dtype_blocks(n: int) -> fx.GraphModule:
    return dtype_blocks(n, fp64=False)


def meta_of(value):
    if isinstance(value, torch.Tensor):
        return (value.dtype, tuple(value.shape), value.stride(), value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(meta_of(v) for v in value)
    return value


def in_place_graph() -> fx.GraphModule:
    def f(x, w):
        h = x @ w
        h.relu_()  # an in-place op on an activation: prepare makes it functional
        return h + x @ w

    return make_fx(f, tracing_mode="fake")(torch.randn(2, 4), torch.randn(4, 4))
