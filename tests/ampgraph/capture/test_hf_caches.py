"""ampgraph/capture/hf_caches.py: every cache class of transformers is a pytree node, so
models returning SSM, hybrid, linear-attention, indexer and model-specific caches are
captured whole, match fp32, and give back caches of the same classes."""

from __future__ import annotations

import functools
import importlib
import sys
import warnings
from collections import Counter

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import ampgraph
from ampgraph.capture import register_hf_caches
from ampgraph.capture.hf_caches import TransformersFormat, cache_classes
from ampgraph.capture.object_nodes import ObjectContext

transformers = pytest.importorskip("transformers")
cache_utils = pytest.importorskip("transformers.cache_utils")

VOCAB = 100
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


# ------------------------------------------------------------------- which classes are nodes


def test_every_cache_and_layer_class_is_registered():
    for module in ("minimax", "deepseek_v4", "xlstm"):  # model files with their own caches
        importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    register_hf_caches()
    found = set(cache_classes(cache_utils))
    names = {cls.__name__ for cls in found}
    assert {
        "Cache", "DynamicCache", "StaticCache", "QuantizedCache", "EncoderDecoderCache",
        "MtpCache", "DFlashCache", "DynamicLayer", "DynamicSlidingWindowLayer",
        "DynamicIndexedLayer", "StaticLayer", "StaticSlidingWindowLayer", "StaticIndexedLayer",
        "QuantizedLayer", "Fp8QuantizedLayer", "LinearAttentionLayer",
        "LinearAttentionAndFullAttentionLayer", "LinearAttentionAndSlidingWindowAttentionLayer",
        "LinearAttentionAndStaticFullAttentionLayer",
        "LinearAttentionAndStaticSlidingWindowAttentionLayer", "DummyLayer",
        "MiniMaxCache", "DeepseekV4HCACache", "DeepseekV4CSACache", "xLSTMCache",
    } <= names
    assert all(cls in pytree.SUPPORTED_NODES for cls in found)


def test_a_modeling_file_imported_later_is_picked_up():
    register_hf_caches()
    module = importlib.import_module("transformers.models.mimi.modeling_mimi")
    register_hf_caches()  # more modules now: the classes are looked for again
    assert module.MimiConv1dPaddingCache in pytree.SUPPORTED_NODES  # named *Cache, no base


def test_a_cache_class_defined_in_a_running_script_is_registered_at_capture():
    register_hf_caches()

    class ScriptCache(transformers.DynamicCache):  # no module imported with it
        pass

    register_hf_caches(rescan=True)  # what export_module asks for
    assert ScriptCache in pytree.SUPPORTED_NODES

    class Step(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            cache = ScriptCache()
            cache.update(self.proj(x), self.proj(x) * 2, 0)
            return x.sum(), cache

    net = ampgraph.compile(Step(), amp_level="O2", dtype="bf16")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        _, cache = net(torch.randn(2, 1, 3, 4))
    assert type(cache) is ScriptCache and cache.get_seq_length() == 3
    assert [e.path for e in ampgraph.explain(net).eager] == []


# -------------------------------------------------------------------- flatten and rebuild


def _filled(layer):
    """A layer holding states, filled through its own update methods."""
    if isinstance(layer, cache_utils.LinearAttentionCacheLayerMixin):
        layer.update_conv_state(torch.randn(2, 6, 4))
        layer.update_recurrent_state(torch.randn(2, 3, 4, 4))
    if isinstance(layer, cache_utils.CacheLayerMixin):
        layer.update(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4))
    if isinstance(layer, cache_utils.DynamicIndexedLayer):
        layer.update_indexer(torch.randn(2, 5, 8))
    return layer


def _dynamic_cache(*layers):
    cache = transformers.DynamicCache()
    cache.layers = [_filled(layer) for layer in layers]
    cache.layer_class_to_replicate = None
    return cache


@pytest.mark.parametrize("layers", [
    lambda: [cache_utils.LinearAttentionLayer(), cache_utils.DynamicLayer()],  # jamba, bamba
    lambda: [cache_utils.LinearAttentionAndFullAttentionLayer()],  # falcon_h1, zaya
    lambda: [cache_utils.LinearAttentionAndSlidingWindowAttentionLayer(sliding_window=3)],
    lambda: [cache_utils.DynamicIndexedLayer(), cache_utils.DummyLayer()],  # deepseek_v32
], ids=["linear", "hybrid", "hybrid_sliding", "indexed"])
def test_dynamic_cache_of_any_layers_round_trips_as_the_same_classes(layers):
    register_hf_caches()
    cache = _dynamic_cache(*layers())
    leaves, spec = pytree.tree_flatten(cache)
    assert isinstance(spec.context, ObjectContext)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    rebuilt = pytree.tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t
                                     for t in leaves], spec)
    assert type(rebuilt) is transformers.DynamicCache
    assert [type(a) for a in rebuilt.layers] == [type(b) for b in cache.layers]
    again, spec_again = pytree.tree_flatten(rebuilt)
    assert spec_again == spec
    for a, b in zip([t for t in again if isinstance(t, torch.Tensor)], tensors):
        assert a is not b and torch.equal(a, b)
    for mine, theirs in zip(rebuilt.layers, cache.layers):  # flags kept, containers fresh
        assert vars(mine).keys() == vars(theirs).keys()
        if hasattr(theirs, "has_previous_state"):
            assert mine.has_previous_state == theirs.has_previous_state
            assert mine.has_previous_state is not theirs.has_previous_state


def test_plain_dynamic_cache_keeps_transformers_own_format():
    register_hf_caches()
    cache = _dynamic_cache(cache_utils.DynamicLayer(),
                           cache_utils.DynamicSlidingWindowLayer(sliding_window=8))
    leaves, spec = pytree.tree_flatten(cache)
    assert spec.context == TransformersFormat(("key_cache", "value_cache"), (None, 8))
    hash(spec)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert [type(a) for a in rebuilt.layers] == [type(b) for b in cache.layers]
    assert rebuilt.get_seq_length() == 5


class _Ops(TorchDispatchMode):
    """The names of the aten ops run under it."""

    def __init__(self):
        super().__init__()
        self.names = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _layer_state(layer):
    return {k: (v.dtype, v.shape, v.tolist()) if isinstance(v, torch.Tensor) else v
            for k, v in vars(layer).items()}


def test_a_plain_dynamic_cache_is_rebuilt_around_its_tensors_as_transformers_leaves_it():
    from transformers.integrations.executorch import _unflatten_dynamic_cache

    register_hf_caches()
    cache = _dynamic_cache(cache_utils.DynamicLayer(), cache_utils.DynamicLayer())
    leaves, spec = pytree.tree_flatten(cache)
    fresh = [t.clone() for t in leaves]
    with _Ops() as ops:
        rebuilt = pytree.tree_unflatten(fresh, spec)
    assert ops.names["cat"] == 0  # transformers' rebuild: a cat per layer's keys and values
    keys, values = fresh[:2], fresh[2:]  # transformers' order: every key, then every value
    theirs = _unflatten_dynamic_cache([keys, values], [list(spec.context.keys),
                                                       list(spec.context.layout)])
    assert type(rebuilt) is type(theirs) is transformers.DynamicCache
    assert vars(rebuilt).keys() == vars(theirs).keys()
    assert rebuilt.layer_class_to_replicate is theirs.layer_class_to_replicate is None
    for layer, their_layer, k, v in zip(rebuilt.layers, theirs.layers, keys, values):
        assert type(layer) is type(their_layer) is cache_utils.DynamicLayer
        assert layer.keys is k and layer.values is v  # the graph's outputs, not copies
        assert _layer_state(layer) == _layer_state(their_layer)
    assert rebuilt.get_seq_length() == 5
    rebuilt.update(torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4), layer_idx=0)
    assert rebuilt.get_seq_length() == 6
    assert torch.equal(rebuilt.layers[0].keys[:, :, :5], keys[0])  # a new tensor, as eager's
    assert torch.equal(keys[0], leaves[0])


@pytest.mark.parametrize("second", ["sliding_window", "empty"])
def test_other_plain_dynamic_caches_are_rebuilt_by_transformers(second):
    register_hf_caches()
    if second == "sliding_window":
        cache = _dynamic_cache(cache_utils.DynamicLayer(),
                               cache_utils.DynamicSlidingWindowLayer(sliding_window=8))
    else:  # a layer without states (a KV-sharing consumer's)
        cache = _dynamic_cache(cache_utils.DynamicLayer())
        cache.layers.append(cache_utils.DynamicLayer())
    leaves, spec = pytree.tree_flatten(cache)
    with _Ops() as ops:
        rebuilt = pytree.tree_unflatten([t.clone() for t in leaves], spec)
    assert ops.names["cat"] > 0  # transformers' DynamicCache(...): its updates
    assert [type(a) for a in rebuilt.layers] == [type(b) for b in cache.layers]
    assert [a.is_initialized for a in rebuilt.layers] == [b.is_initialized for b in cache.layers]


def test_a_returned_cache_costs_no_copy_and_decodes_and_generates_like_eager():
    """Prefill, then the cache fed back twice, and generate(): the same logits and caches
    as the eager model (O0: no casts), and a decode step runs the ``cat``s the eager model
    runs (its layers' updates, rotary embeddings) and no more."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL)).eval()
    net = ampgraph.compile(model, amp_level="O0")
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache, ref_cache = net(input_ids=ids).past_key_values, model(input_ids=ids).past_key_values
        for step in range(2):
            nxt = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(step))
            counts = []
            for run, c in ((net, cache), (model, ref_cache)):
                with _Ops() as ops:
                    out = run(input_ids=nxt, past_key_values=c)
                counts.append(ops.names["cat"])
                assert out.past_key_values is c
            if step:  # (the first captured the decode graph)
                assert counts[0] == counts[1]
            for mine, theirs in zip(cache.layers, ref_cache.layers):
                assert type(mine) is cache_utils.DynamicLayer and mine.is_initialized
                torch.testing.assert_close(mine.keys, theirs.keys, rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(mine.values, theirs.values, rtol=1e-5, atol=1e-6)
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                  do_sample=False, pad_token_id=0)
    assert torch.equal(net.generate(**kwargs), model.generate(**kwargs))


def test_static_and_model_specific_caches_round_trip():
    from transformers.models.minimax.modeling_minimax import MiniMaxCache

    register_hf_caches()
    config = transformers.LlamaConfig(**SMALL)
    static = transformers.StaticCache(config=config, max_cache_len=16)
    head = SMALL["hidden_size"] // SMALL["num_attention_heads"]
    for idx in range(2):
        static.update(torch.randn(1, 2, 3, head), torch.randn(1, 2, 3, head), idx)
    minimax = MiniMaxCache()
    minimax.set_linear_cache(0, torch.randn(2, 4, 8, 8))
    minimax.update(torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4), 1)
    for cache in (static, minimax):
        leaves, spec = pytree.tree_flatten(cache)
        rebuilt = pytree.tree_unflatten(leaves, spec)
        assert type(rebuilt) is type(cache)
        assert rebuilt.get_seq_length(1) == cache.get_seq_length(1)
    assert rebuilt.get_linear_cache(0) is minimax.get_linear_cache(0)
    assert rebuilt.linear_cache is not minimax.linear_cache


def test_a_cache_that_cannot_be_rebuilt_says_why():
    register_hf_caches()
    cache = _dynamic_cache(cache_utils.LinearAttentionLayer())
    cache.get_seq_length = cache.get_mask_sizes  # a method bound onto the instance
    with pytest.raises(TypeError, match="DynamicCache: its attribute 'get_seq_length' is a "
                                        "method bound to the object itself"):
        pytree.tree_flatten(cache)


# ---------------------------------------------------------------------- whole models


def _mamba():
    return transformers.MambaForCausalLM(transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2,
        conv_kernel=4, time_step_rank=4))


def _jamba():
    return transformers.JambaForCausalLM(transformers.JambaConfig(
        **SMALL, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, num_experts=2, num_experts_per_tok=1, mamba_d_state=8,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4))


def _minimax():
    return transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(
        **SMALL, layer_types=["linear_attention", "full_attention"], num_local_experts=2,
        num_experts_per_tok=1, block_size=4, head_dim=8))


def _deepseek_v32():
    return transformers.DeepseekV32ForCausalLM(transformers.DeepseekV32Config(
        **{**SMALL, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=1, topk_group=1,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, index_topk=4,
        index_head_dim=16, index_n_heads=2, first_k_dense_replace=1))


def _qwen3_next():
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **SMALL, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
        linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, head_dim=8))


def _cache(out):
    return out.cache_params if hasattr(out, "cache_params") else out.past_key_values


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-30))


def _assert_same_cache(mine, theirs, min_cos: float = 0.99) -> None:
    """The same classes, structure and kept state; every tensor close to fp32's."""
    assert type(mine) is type(theirs)
    assert [type(a) for a in mine.layers] == [type(b) for b in theirs.layers]
    leaves, spec = pytree.tree_flatten(mine)
    ref_leaves, ref_spec = pytree.tree_flatten(theirs)
    assert spec == ref_spec
    tensors = [(a, b) for a, b in zip(leaves, ref_leaves) if isinstance(b, torch.Tensor)]
    assert tensors
    for a, b in tensors:
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
        if b.abs().max() > 0:
            assert _cosine(a, b) >= min_cos


def _prefill(make, amp_level: str = "O2"):
    torch.manual_seed(0)
    model = make().eval()
    net = ampgraph.compile(model, amp_level=amp_level, dtype="bf16")
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback warning
        with torch.no_grad():
            out, ref = net(input_ids=ids), model(input_ids=ids)
    assert [e.path for e in ampgraph.explain(net).eager] == []
    assert _cosine(out.logits, ref.logits) >= 0.99
    return model, net, out, ref


@pytest.mark.parametrize("make", [
    _mamba,
    _jamba,
    _minimax,
    _deepseek_v32,
    pytest.param(_qwen3_next, marks=pytest.mark.slow),
], ids=["mamba", "jamba", "minimax", "deepseek_v32", "qwen3_next"])
def test_model_returning_its_cache_is_captured_whole_and_matches_fp32(make, monkeypatch):
    if make is _qwen3_next:
        # its reference gated delta rule in chunks of 8 tokens, not 64: the same sums split
        # otherwise (eager and compiled alike), and torch.export traces 7 unrolled steps of
        # the chunk's solve instead of 63 (~90 s of capture -> ~10 s)
        from transformers.models.qwen3_next import modeling_qwen3_next as qn

        monkeypatch.setattr(qn, "torch_chunk_gated_delta_rule",
                            functools.partial(qn.torch_chunk_gated_delta_rule, chunk_size=8))
    _, _, out, ref = _prefill(make)
    _assert_same_cache(_cache(out), _cache(ref))


def test_without_casts_the_returned_cache_is_fp32_s():
    _, _, out, ref = _prefill(_jamba, amp_level="O0")
    mine, theirs = _cache(out), _cache(ref)
    _assert_same_cache(mine, theirs)
    for a, b in zip(pytree.tree_leaves(mine), pytree.tree_leaves(theirs)):
        if isinstance(b, torch.Tensor):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_decoding_from_a_hybrid_cache_updates_it_in_place_with_one_graph():
    model, net, out, ref = _prefill(_jamba)
    cache, ref_cache = _cache(out), _cache(ref)
    for step in range(2):
        nxt = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(5 + step))
        with torch.no_grad():
            o = net(input_ids=nxt, past_key_values=cache)
            r = model(input_ids=nxt, past_key_values=ref_cache)
        assert o.past_key_values is cache  # the caller's object, as eager
        assert cache.get_seq_length() == ref_cache.get_seq_length() == 9 + step
        assert _cosine(o.logits, r.logits) >= 0.99
        _assert_same_cache(cache, ref_cache)
    assert [e.path for e in ampgraph.explain(net).eager] == []
    assert sum(len(g) for g in net._amp_graphs.values()) == 2  # prefill + one decode graph


def test_static_cache_passed_in_is_filled_in_place_with_one_decode_graph():
    config = transformers.LlamaConfig(**SMALL)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    mine, theirs = (transformers.StaticCache(config=config, max_cache_len=16) for _ in "ab")
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    for step in range(3):  # prefill, then two decode steps
        with torch.no_grad():
            o = net(input_ids=ids, past_key_values=mine)
            r = model(input_ids=ids, past_key_values=theirs)
        assert o.past_key_values is mine
        assert int(mine.get_seq_length()) == int(theirs.get_seq_length()) == 8 + step
        assert _cosine(o.logits, r.logits) >= 0.99
        _assert_same_cache(mine, theirs)
        ids = torch.randint(0, VOCAB, (2, 1), generator=torch.Generator().manual_seed(7 + step))
    assert [e.path for e in ampgraph.explain(net).eager] == []
    assert sum(len(g) for g in net._amp_graphs.values()) == 2


# ------------------------------------------------------------------- registration


def test_cache_registration_is_idempotent_and_leaves_existing_registrations():
    from torch.utils import _pytree as pytree
    from transformers.integrations.executorch import register_dynamic_cache_export_support

    from ampgraph.capture import register_hf_caches

    register_hf_caches()
    register_hf_caches()
    register_dynamic_cache_export_support()  # the user's own call after ours still works
    assert transformers.DynamicCache in pytree.SUPPORTED_NODES
    assert transformers.EncoderDecoderCache in pytree.SUPPORTED_NODES


def test_nothing_is_registered_before_transformers_caches_are_imported(monkeypatch):
    from ampgraph.capture import hf_caches

    monkeypatch.setattr(hf_caches, "_modules_seen", 0)
    monkeypatch.delitem(sys.modules, "transformers.cache_utils")
    hf_caches.register_hf_caches()
    assert hf_caches._modules_seen == 0  # tried again once they are imported


def test_an_encoder_decoder_cache_flattens_to_its_two_caches_and_back():
    from torch.utils import _pytree as pytree

    from ampgraph.capture import register_hf_caches

    register_hf_caches()
    cache = transformers.EncoderDecoderCache(transformers.DynamicCache(),
                                             transformers.DynamicCache())
    children, spec = pytree.tree_flatten(cache)
    rebuilt = pytree.tree_unflatten(children, spec)
    assert type(rebuilt) is transformers.EncoderDecoderCache
    assert type(rebuilt.self_attention_cache) is transformers.DynamicCache
    assert rebuilt.get_seq_length() == 0
