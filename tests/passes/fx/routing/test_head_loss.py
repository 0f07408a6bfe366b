"""passes/fx/routing/head_loss.py: the head's product and its cross-entropy fused into the
runtime's chunked op, on transformers' models and on a loss the user writes: the loss and
every gradient equal the unfused O2's (bit for bit where the rows fit one chunk); the
logits are dropped only where asked; what is not fused says why."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampgraph

transformers = pytest.importorskip("transformers")


def hf_model(kind: str) -> tuple[nn.Module, dict]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    tf = transformers
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=64, vocab_size=300))
    elif kind == "gpt2":  # tied input and output embeddings
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300,
                                                 resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    elif kind == "bert":  # tied, a decoder bias, most labels ignored
        model = tf.BertForMaskedLM(tf.BertConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
            vocab_size=300, hidden_dropout_prob=0, attention_probs_dropout_prob=0))
    else:  # t5: tied, scaled decoder output, no .float() before its loss
        model = tf.T5ForConditionalGeneration(tf.T5Config(
            d_model=32, d_ff=64, d_kv=16, num_layers=1, num_heads=2, vocab_size=300,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    ids = torch.randint(1, 300, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, ::3] = -100
    inputs = {"input_ids": ids, "labels": labels}
    if kind == "t5":
        inputs["labels"] = torch.randint(1, 300, (2, 7), generator=g)
    return model, inputs


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def fused_rows(net: nn.Module) -> list[dict]:
    return [r for r in ampgraph.explain(net).nodes
            if "fused with the head's product" in r["reason"]]


@pytest.mark.parametrize("kind", ["llama", "gpt2", "bert", "t5"])
def test_fused_head_equals_the_unfused_o2_loss_and_gradients(kind):
    model, inputs = hf_model(kind)
    ref_model = copy.deepcopy(model)
    fused = ampgraph.compile(model, "O2", "bf16", head_loss="drop_logits")
    plain = ampgraph.compile(ref_model, "O2", "bf16", head_loss="off")
    out, ref = fused(**inputs), plain(**inputs)
    out.loss.backward()
    ref.loss.backward()
    assert out.logits is None and ref.logits is not None
    # the rows fit one chunk: aten's own kernels on it, the same products, bit for bit
    assert torch.equal(out.loss, ref.loss), (out.loss, ref.loss)
    got, want = grads_of(model), grads_of(ref_model)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    (row,) = fused_rows(fused)
    assert "chunks of" in row["reason"] and row["flops"] > 0
    assert not fused_rows(plain)


def test_returned_logits_stay_unless_asked_and_the_reason_says_why():
    model, inputs = hf_model("llama")
    net = ampgraph.compile(model, "O2", "bf16")  # head_loss="auto"
    out = net(**inputs)
    assert out.logits is not None and out.logits.shape == (2, 12, 300)
    assert not fused_rows(net)
    (ce,) = [r for r in ampgraph.explain(net).nodes if r["op"] == "aten.cross_entropy_loss"]
    assert "not fused with the head: its logits are returned too" in ce["reason"]


def test_drop_logits_keeps_them_in_evaluation():
    model, inputs = hf_model("llama")
    net = ampgraph.compile(model, "O2", "bf16", head_loss="drop_logits")
    assert net(**inputs).logits is None
    net.eval()
    with torch.no_grad():
        out = net(**inputs)
    assert out.logits is not None and torch.isfinite(out.loss)


class OwnLoss(nn.Module):
    """A head and the user's own cross-entropy on its logits, only the loss returned."""

    def __init__(self, **ce: object) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.GELU())
        self.head = nn.Linear(32, 100)
        self.ce = ce

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(x))
        return F.cross_entropy(logits.flatten(0, 1), y.flatten(), **self.ce)


@pytest.mark.parametrize("ce", [
    {"label_smoothing": 0.1},
    {"reduction": "sum", "ignore_index": 7},
    {"reduction": "mean", "ignore_index": -1, "label_smoothing": 0.2},
])
def test_a_loss_only_model_is_fused_by_default_with_its_arguments_kept(ce):
    torch.manual_seed(0)
    model = OwnLoss(**ce)
    ref_model = copy.deepcopy(model)
    x, y = torch.randn(3, 10, 16), torch.randint(0, 100, (3, 10))
    y[0, :4] = ce.get("ignore_index", -100)
    net = ampgraph.compile(model, "O2", "bf16")
    ref = ampgraph.compile(ref_model, "O2", "bf16", head_loss="off")
    loss, want = net(x, y), ref(x, y)
    loss.backward()
    want.backward()
    assert fused_rows(net) and not fused_rows(ref)
    assert torch.allclose(loss, want, rtol=1e-3)
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        assert (p.grad - q.grad).norm() <= 1e-2 * q.grad.norm(), name


def test_what_cannot_be_fused_stays_as_it_was():
    torch.manual_seed(0)
    x, y = torch.randn(3, 10, 16), torch.randint(0, 100, (3, 10))
    for ce in ({"reduction": "none"}, {"weight": torch.rand(100)}):
        net = ampgraph.compile(OwnLoss(**ce), "O2", "bf16")
        out = net(x, y)
        assert not fused_rows(net) and torch.isfinite(out).all()


def fused_and_unfused_steps(kind: str, dtype: str) -> tuple[list, list, dict, list]:
    """Three steps each of build_train_step with the head fused (the default) and with
    ``head_loss="off"``, from one model: (models, steps, inputs, losses)."""
    model, inputs = hf_model(kind)
    models, steps = [model, copy.deepcopy(model)], []
    for m, head_loss in zip(models, ("auto", "off")):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        steps.append(ampgraph.build_train_step(m, None, opt, "O2", dtype, head_loss=head_loss))
    losses = [[float(step(**inputs).loss) for _ in range(3)] for step in steps]
    return models, steps, inputs, losses


def test_the_train_step_fuses_the_head_and_matches_the_unfused_step():
    (model, ref_model), steps, inputs, losses = fused_and_unfused_steps("gpt2", "bf16")
    assert losses[0] == losses[1]  # one chunk: the unfused step's values, bit for bit
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    assert fused_rows(steps[0].module) and not fused_rows(steps[1].module)
    # the module called directly still returns the logits: the step's graph is its own
    assert steps[0].module(**inputs).logits.shape == (2, 12, 300)


def test_an_fp16_step_with_dynamic_loss_scaling_trains_as_the_unfused_one():
    # fp16: backward forms the head's gradients, after the loss scale reaches them
    (model, ref_model), _, _, losses = fused_and_unfused_steps("llama", "fp16")
    assert losses[0] == losses[1]
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
