"""A HuggingFace transformers BERT built from a small config (nothing downloaded)."""

from __future__ import annotations

import pytest
import torch

import ampgraph
from tests.helpers import MATMUL_OPS, cosine, record

transformers = pytest.importorskip("transformers")


def small_bert():
    config = transformers.BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=64, num_labels=3,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(config)


def batch(n=4, seq=12):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 120, (n, seq), generator=g)
    mask = torch.ones(n, seq, dtype=torch.long)
    mask[1, seq // 2:] = 0
    mask[3, 3:] = 0
    return ids, mask, torch.tensor([0, 1, 2, 1][:n])


def test_hf_bert_compiles_at_o2_with_attention_mask_and_matches_fp32():
    model = small_bert().eval()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    ids, mask, _ = batch()
    with torch.no_grad():
        out, rec = record(lambda: net(input_ids=ids, attention_mask=mask))
        ref = model(input_ids=ids, attention_mask=mask)
    assert type(out) is type(ref), "ModelOutput structure is kept"
    assert out.logits.dtype == torch.float32
    assert cosine(out.logits, ref.logits) >= 0.999
    assert {d[0] for _, d in rec.inputs_of(MATMUL_OPS)} == {torch.bfloat16}
    assert rec.norm_compute_dtypes() == {torch.float32}
    # padding really is masked: changing padded tokens changes nothing
    ids2 = ids.clone()
    ids2[1, 6:] = 7
    with torch.no_grad():
        out2 = net(input_ids=ids2, attention_mask=mask)
    torch.testing.assert_close(out2.logits[1], out.logits[1])


def test_hf_bert_trains_backward_and_optimizer_step():
    model = small_bert().train()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids, mask, labels = batch()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    losses = []
    for _ in range(8):
        out = net(input_ids=ids, attention_mask=mask, labels=labels)
        assert out.loss.dtype == torch.float32
        opt.zero_grad()
        out.loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and g.dtype == torch.float32 for g in grads)
        opt.step()
        losses.append(out.loss.item())
    assert all(p.dtype == torch.float32 for p in model.parameters()), "master weights stay fp32"
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "classifier.weight" in changed and "bert.encoder.layer.0.attention.self.query.weight" \
        in changed
    assert losses[-1] < losses[0], losses
    report = ampgraph.explain(net)
    assert not report.eager, "the whole HF model is captured"
    assert any(r["op"] == "aten.scaled_dot_product_attention" and r["precision"] == "bf16"
               or r["op"] == "aten.linear" and r["precision"] == "bf16" for r in report.nodes)
