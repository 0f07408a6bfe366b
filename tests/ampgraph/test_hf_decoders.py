"""HuggingFace decoder LLMs (tiny configs, random weights, nothing downloaded): capture
leaves the process as it found it, caches are captured in the graph, training and
generate() work through the compiled graph."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

import ampgraph
from ampgraph.capture import preserved_global_state

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


def global_state() -> tuple:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled())


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


def test_failing_export_restores_every_piece_of_global_state(monkeypatch):
    """An export that leaves grad off, autocast on, inference mode entered, the default
    dtype changed, RNG consumed and a mode on the stack, then raises, changes nothing."""
    real_export = torch.export.export

    def leaky_export(*args, **kwargs):
        # entered, never exited (made first: its late destructor puts back a clean state)
        leaky_export.guard = torch._C._InferenceMode(True)
        torch.set_grad_enabled(False)
        torch.set_autocast_enabled("cpu", True)
        torch.set_autocast_dtype("cpu", torch.float16)
        torch.set_autocast_cache_enabled(False)
        torch.autocast_increment_nesting()
        torch.set_default_dtype(torch.float64)
        torch.rand(3)
        random.random()
        raise RuntimeError("export failed on purpose")

    monkeypatch.setattr(torch.export, "export", leaky_export)
    net = ampgraph.compile(torch.nn.Sequential(torch.nn.Linear(4, 4)), dtype="bf16")
    before = global_state()
    torch.manual_seed(5)
    random.seed(5)
    x = torch.randn(2, 4)
    expected = torch.rand(2), random.random()
    torch.manual_seed(5)
    random.seed(5)
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="export failed on purpose"):
        net(x)  # capture fails, the Linear child's too; it runs eagerly
    monkeypatch.setattr(torch.export, "export", real_export)
    assert global_state() == before
    nesting = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    assert nesting == 1
    # the capture attempts consumed no random numbers (the eager forward draws none)
    assert torch.equal(torch.rand(2), expected[0]) and random.random() == expected[1]
    del leaky_export.guard
    assert global_state() == before


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "autocast"])
def test_preserved_global_state_is_transparent_inside_user_contexts(context):
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
           "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[context]
    with ctx():
        before = global_state()
        with preserved_global_state():
            assert global_state() == before  # the body sees the caller's state
            torch.set_grad_enabled(not torch.is_grad_enabled())
            torch.set_default_dtype(torch.float64)
        assert global_state() == before
    with pytest.raises(ValueError), preserved_global_state():
        torch.set_grad_enabled(False)
        raise ValueError
    assert torch.is_grad_enabled()


def test_preserved_global_state_restores_rng():
    torch.manual_seed(3)
    random.seed(3)
    with preserved_global_state():
        torch.rand(5)
        random.random()
    a = torch.rand(2), random.random()
    torch.manual_seed(3)
    random.seed(3)
    assert torch.equal(a[0], torch.rand(2)) and a[1] == random.random()


def test_compile_under_no_grad_keeps_no_grad():
    net = ampgraph.compile(tiny_llama().eval(), dtype="bf16")
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        net(input_ids=tokens())
        assert not torch.is_grad_enabled()
    assert torch.is_grad_enabled()
