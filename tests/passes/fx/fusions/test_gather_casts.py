"""passes/fx/fusions/gather_casts.py: embeddings gather from the fp32 table and cast the
rows."""

from __future__ import annotations

import copy

import torch
from torch import nn

from passes.fx.dtypes import dtype_of, is_amp_cast
from tests.passes.fx.fusions.helpers import passes

aten = torch.ops.aten


class Emb(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb, self.fc = nn.Embedding(vocab, 8), nn.Linear(8, 4)

    def forward(self, ids):
        return self.fc(self.emb(ids))


def test_embedding_gathers_from_the_fp32_table_and_casts_its_smaller_output():
    torch.manual_seed(0)
    model = Emb(100)
    ids = torch.randint(0, 100, (2, 5))
    fused, plain = passes(copy.deepcopy(model), (ids,), True), passes(model, (ids,), False)
    (emb,) = [n for n in fused.graph.nodes if n.target == aten.embedding.default]
    assert emb.args[0].op == "get_attr" and dtype_of(emb) == torch.float32
    assert all(is_amp_cast(u) and dtype_of(u) == torch.bfloat16 for u in emb.users)
    out_f, out_p = fused(ids), plain(ids)
    torch.testing.assert_close(out_f, out_p, rtol=0, atol=0)  # a gather commutes with a cast
    out_f.sum().backward()
    out_p.sum().backward()
    for p, q in zip(fused.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-2, atol=1e-3)
    # a lookup larger than its table keeps casting the table
    small = passes(Emb(3), (torch.randint(0, 3, (4, 5)),), True)
    (emb,) = [n for n in small.graph.nodes if n.target == aten.embedding.default]
    assert is_amp_cast(emb.args[0])
