"""passes/fx/layouts.py: a low-precision linear never takes a batched copy where its input
folds into one matrix product (torchvision ViT's sequence-first in-projection)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.runtime.cpu import packed
from passes.fx.layouts import CONTIGUOUS, foldable
from tests.helpers import cosine, record

LINEAR_PATHS = {"bmm", "mm", "addmm", "_linear_pointwise"}  # the last: a packed weight


class SeqFirst(nn.Module):
    """LayerNorm, then a linear on the transposed (sequence-first) activation."""

    def __init__(self, d: int = 16, transpose: bool = True):
        super().__init__()
        self.ln, self.fc = nn.LayerNorm(d), nn.Linear(d, 3 * d)
        self.transpose = transpose

    def forward(self, x):
        h = self.ln(x)
        return self.fc(h.transpose(0, 1) if self.transpose else h)


def linear_kernels(fn) -> list[str]:
    _, rec = record(fn)
    return [name for name, _ in rec.calls if name in LINEAR_PATHS]


def contiguous_nodes(net) -> int:
    (_, part), = net.amp_parts()[0]
    return len(part.gm.graph.find_nodes(op="call_function", target=CONTIGUOUS))


def test_fp32_and_a_bare_low_linear_take_the_batched_path():
    """What the pass is for: without it the bf16 linear runs bmm over an expanded weight."""
    x = torch.randn(4, 9, 16).transpose(0, 1)
    w, b = torch.randn(48, 16), torch.randn(48)
    with torch.no_grad():
        assert linear_kernels(lambda: nn.functional.linear(x.bfloat16(), w.bfloat16(),
                                                           b.bfloat16())) == ["bmm"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sequence_first_linear_runs_one_matrix_product_at_o2(dtype):
    torch.manual_seed(0)
    model = SeqFirst().eval()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16" if dtype is torch.bfloat16
                           else "fp16")
    x = torch.randn(4, 9, 16)
    with torch.no_grad():
        out = net(x)
        kernels = linear_kernels(lambda: net(x))
        ref = model(x)
    # folded: one product (oneDNN's on a packed weight where it runs the dtype, else
    # aten's), no weight copy per position
    assert kernels == (["_linear_pointwise"] if packed._runs(dtype) else ["addmm"]), kernels
    assert contiguous_nodes(net) == 1
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert cosine(out, ref) >= 0.999


def test_contiguous_inputs_are_left_alone():
    torch.manual_seed(0)
    net = ampgraph.compile(SeqFirst(transpose=False).eval(), amp_level="O2", dtype="bf16")
    x = torch.randn(4, 9, 16)
    with torch.no_grad():
        net(x)
    assert contiguous_nodes(net) == 0


def test_training_gradients_unchanged_by_the_copy():
    torch.manual_seed(0)
    model = SeqFirst().train()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    x = torch.randn(4, 9, 16)
    net(x).square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().mean().backward()
    for g, r in zip(got, (p.grad for p in model.parameters())):
        assert cosine(g, r) >= 0.99


def test_foldable():
    x = torch.randn(4, 9, 16)
    assert foldable(x) and foldable(x[:2])  # a slice of the leading dim still folds
    assert not foldable(x[:, :5])  # a slice of a middle dim does not
    assert not foldable(x.transpose(0, 1))
    assert foldable(x.transpose(1, 2).transpose(1, 2))
