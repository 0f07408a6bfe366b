"""HuggingFace decoder LLMs (tiny configs, random weights, nothing downloaded): capture
leaves the process as it found it, caches are captured in the graph, training and
generate() work through the compiled graph."""

from __future__ import annotations

import warnings

import pytest
import torch

import ampgraph
from tests.helpers import global_state

transformers = pytest.importorskip("transformers")

VOCAB = 100


def tiny_llama(cls_name: str = "Llama", seed: int = 0, **overrides):
    config_cls = getattr(transformers, f"{cls_name}Config")
    model_cls = getattr(transformers, f"{cls_name}ForCausalLM")
    kwargs = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    return model_cls(config_cls(**kwargs))


def tokens(batch: int = 2, seq: int = 8, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- global state


def test_train_call_of_compiled_llama_keeps_grad_mode_and_backward_fills_grads():
    model = tiny_llama().train()
    assert model.config.use_cache  # the config's default, left alone
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    ids = tokens()
    before = global_state()
    out = net(input_ids=ids, labels=ids)
    assert global_state() == before
    assert torch.is_grad_enabled()
    out.loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads)
    assert all(torch.isfinite(g).all() for g in grads)


def test_compile_under_no_grad_keeps_no_grad():
    net = ampgraph.compile(tiny_llama().eval(), dtype="bf16")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net(input_ids=tokens())
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()


# ---------------------------------------------------------------------------- caches


def eager_parts(net) -> list[str]:
    return [e.path for e in ampgraph.explain(net).eager]


@pytest.mark.parametrize("family", ["Llama", "Qwen2", "Mistral"])
def test_decoder_with_cache_is_captured_whole_and_decodes_from_its_cache(family):
    model = tiny_llama(family).eval()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    ids = tokens()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        with torch.no_grad():
            out, ref = net(input_ids=ids), model(input_ids=ids)
    cache = out.past_key_values
    assert type(cache) is type(ref.past_key_values) is transformers.DynamicCache
    assert cache.get_seq_length() == 8
    assert eager_parts(net) == []
    torch.testing.assert_close(out.logits, ref.logits, atol=0.03, rtol=0.05)
    ref_cache = ref.past_key_values
    for step in range(3):  # cache lengths 8, 9, 10: one graph (dynamic length)
        nxt = tokens(seq=1, seed=10 + step)
        with torch.no_grad():
            o = net(input_ids=nxt, past_key_values=cache)
            r = model(input_ids=nxt, past_key_values=ref_cache)
        assert o.past_key_values is cache  # updated in place, as eager does
        assert cache.get_seq_length() == ref_cache.get_seq_length() == 9 + step
        torch.testing.assert_close(o.logits, r.logits, atol=0.03, rtol=0.05)
        for mine, theirs in zip(cache.layers, ref_cache.layers):
            torch.testing.assert_close(mine.keys, theirs.keys, atol=0.03, rtol=0.05)
    assert eager_parts(net) == []
    assert sum(len(g) for g in net._amp_graphs.values()) == 2  # prefill + one decode graph


def test_encoder_decoder_cache_round_trips():
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.BartForConditionalGeneration(config).eval()
    net = ampgraph.compile(model, dtype="bf16")
    ids = tokens(seed=2)
    with torch.no_grad():
        out = net(input_ids=ids, decoder_input_ids=ids[:, :4])
        cache = out.past_key_values
        assert isinstance(cache, transformers.EncoderDecoderCache)
        step = net(encoder_outputs=(out.encoder_last_hidden_state,),
                   decoder_input_ids=ids[:, 4:5], past_key_values=cache)
    assert step.past_key_values is cache and cache.get_seq_length() == 5
    assert all(cache.is_updated.values())  # cross-attention computed once, then reused
    assert eager_parts(net) == []


# ---------------------------------------------------------------------------- training


def test_llama_trains_at_o2_like_fp32():
    """20 AdamW steps on one batch, default kwargs (use_cache from the config)."""
    ids = tokens(batch=4, seq=8, seed=3)

    def run(compiled: bool) -> list[float]:
        model = tiny_llama(seed=7).train()
        net = ampgraph.compile(model, amp_level="O2", dtype="bf16") if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses = []
        for _ in range(20):
            loss = net(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        if compiled:
            assert eager_parts(net) == []
        return losses

    grad_mode = torch.is_grad_enabled()
    ref, amp = run(False), run(True)
    assert torch.is_grad_enabled() == grad_mode
    assert abs(amp[0] - ref[0]) < 0.02  # same start (bf16 forward)
    assert amp[-1] < amp[0] - 1.0  # clearly learning
    assert abs(amp[-1] - ref[-1]) < 0.1 * ref[-1] + 0.05


# ---------------------------------------------------------------------------- generate


def _greedy_agrees(tokens_a: torch.Tensor, tokens_b: torch.Tensor, model, prompt_len: int,
                   margin: float = 0.05) -> None:
    """Equal greedy tokens, or where they first differ, the fp32 model's top two logits
    at that step are within ``margin`` (a near tie that bf16 may break either way)."""
    if torch.equal(tokens_a, tokens_b):
        return
    row, col = (tokens_a != tokens_b).nonzero()[0].tolist()
    assert col >= prompt_len
    with torch.no_grad():
        logits = model(input_ids=tokens_b[row:row + 1, :col]).logits[0, -1]
    top = logits.topk(2).values
    assert (top[0] - top[1]).item() < margin, (tokens_a, tokens_b)


def test_generate_runs_the_compiled_graph_with_its_cache():
    model = tiny_llama().eval()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    seen = []
    real = net._select  # what forward asks for its graph

    def spy(args, kwargs):
        compiled = real(args, kwargs)
        seen.append((kwargs.get("past_key_values"), compiled))
        return compiled

    net._select = spy
    ids = tokens(seq=6)
    mask = torch.ones_like(ids)
    assert net.can_generate() and net.config is model.config
    out = net.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                       pad_token_id=0)
    ref = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                         do_sample=False, pad_token_id=0)
    assert out.shape == ref.shape == (2, 10)
    _greedy_agrees(out, ref, model, prompt_len=6)
    assert len(seen) == 4  # prefill + 3 decode steps, each through the compiled module
    assert all(compiled is not None for _, compiled in seen)
    caches = {id(c) for c, _ in seen}
    assert len(caches) == 1 and isinstance(seen[0][0], transformers.DynamicCache)
    assert eager_parts(net) == []
    assert "_amp_route" not in model.__dict__
    # the same tokens at O0 (no casts): the routing alone changes nothing
    o0 = ampgraph.compile(model, amp_level="O0")
    assert torch.equal(o0.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4,
                                   do_sample=False, pad_token_id=0), ref)
