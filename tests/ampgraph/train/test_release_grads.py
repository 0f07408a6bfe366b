"""ampgraph/train/release_grads.py: build_train_step(release_grads=True) steps each
parameter in backward and frees its gradient: the same training as the step that keeps
them, never the whole model's gradients alive at once, and what it cannot honour refused."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampgraph
from ampgraph.train.loss_scale import FixedLossScaleManager

pytestmark = pytest.mark.usefixtures("one_thread")

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "adam-groups": lambda ps: torch.optim.Adam(
        [{"params": ps[:2], "lr": 1e-2}, {"params": ps[2:], "lr": 3e-3}]),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True),
}


def net(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 32),
                         nn.GELU(), nn.Linear(32, 10))


def batches(n: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [(torch.randn(8, 16, generator=g), torch.randint(0, 10, (8,), generator=g))
            for _ in range(n)]


def train(model: nn.Module, make_opt, release: bool, **kwargs) -> list[float]:
    opt = make_opt(list(model.parameters()))
    step = ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16",
                                     release_grads=release, **kwargs)
    losses = []
    for x, y in batches():
        losses.append(float(step(x, y).loss))
        if release:
            assert all(p.grad is None for p in model.parameters())
    return losses


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_released_gradients_train_exactly_as_kept_ones(name):
    kept, released = net(), net()
    assert train(kept, OPTIMIZERS[name], False) == train(released, OPTIMIZERS[name], True)
    for p, q in zip(kept.parameters(), released.parameters()):
        assert torch.equal(p, q)


OPTIMIZERS_MORE = OPTIMIZERS | {
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS_MORE))
def test_parameters_stepped_in_chunks_train_and_keep_state_exactly_as_whole(name, monkeypatch):
    import ampgraph.train.release_grads as release_grads

    kept, released = net(), net()
    opt_kept, opt_released = (OPTIMIZERS_MORE[name](list(m.parameters()))
                              for m in (kept, released))
    # 1024, 512, 320 elements: whole chunks and a half one. A chunk is a multiple of the
    # vector width, as CHUNK: the fused kernels compute a scalar tail in another way
    monkeypatch.setattr(release_grads, "CHUNK", 128)
    steps = [ampgraph.build_train_step(m, F.cross_entropy, o, "O2", "bf16",
                                       release_grads=r)
             for m, o, r in ((kept, opt_kept, False), (released, opt_released, True))]
    for x, y in batches():
        assert float(steps[0](x, y).loss) == float(steps[1](x, y).loss)
    for p, q in zip(kept.parameters(), released.parameters()):
        assert torch.equal(p, q)
    a, b = opt_kept.state_dict()["state"], opt_released.state_dict()["state"]
    assert a.keys() == b.keys()
    for i in a:
        assert a[i].keys() == b[i].keys()
        for k, v in a[i].items():  # whole entries, the parameter's shape, not chunks
            assert torch.equal(v, b[i][k]) if isinstance(v, torch.Tensor) else v == b[i][k]


def test_no_optimizer_temporary_is_larger_than_a_chunk(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    import ampgraph.train.release_grads as release_grads

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(t, torch.Tensor) and t._base is None and t.dim() > 0:
                    Largest.numel = max(Largest.numel, t.numel())
            return out

    call = release_grads.ReleasedGradients._call

    def watched(self):
        with Largest():
            call(self)

    monkeypatch.setattr(release_grads, "CHUNK", 128)
    monkeypatch.setattr(release_grads.ReleasedGradients, "_call", watched)
    model = nn.Linear(64, 64)  # 4096 weights: 32 chunks
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # the default: per-parameter temps
    step = ampgraph.build_train_step(model, lambda out, y: out.float().square().mean(), opt,
                                     "O2", "bf16", release_grads=True)
    for _ in range(2):  # the first step makes the state, the second reads it
        step(torch.randn(2, 64), None)
    assert 0 < Largest.numel <= 128


@pytest.mark.parametrize("master", ["kahan", "stochastic"])
def test_sixteen_bit_weights_tiers_release_their_gradients_too(master):
    kept, released = net(), net()
    make = OPTIMIZERS["adamw"]
    a = train(kept, make, False, master_weights=master)
    b = train(released, make, True, master_weights=master)
    # Kahan is deterministic; stochastic rounding draws its noise in another order
    assert a == b if master == "kahan" else a == pytest.approx(b, rel=2e-2)
    assert all(p.dtype == torch.bfloat16 for p in released[0].parameters())


def test_no_two_gradients_are_alive_at_once_in_backward():
    model = net()
    alive = []
    for p in model.parameters():  # registered first: runs before the step's own hook
        p.register_post_accumulate_grad_hook(
            lambda p: alive.append(sum(q.grad is not None for q in model.parameters())))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16",
                                     release_grads=True)
    step(*batches(1)[0])
    assert len(alive) == len(list(model.parameters())) and set(alive) == {1}
    assert step.released.stepped == len(alive)


def test_a_non_finite_loss_steps_nothing_and_says_so():
    model = net()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16",
                                     release_grads=True)
    x, y = batches(1)[0]
    out = step(x.clone().fill_(float("nan")), y)
    assert out.overflow and step.released.stepped == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    assert not step(x, y).overflow  # the flag is cleared for the next step


def test_a_backward_of_the_users_own_is_left_alone():
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16", release_grads=True)
    before = [p.detach().clone() for p in model.parameters()]
    x, y = batches(1)[0]
    F.cross_entropy(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"clip_grad_norm": 1.0}, "clip_grad_norm"),
    ({"accumulation_steps": 2}, "accumulation_steps"),
    ({"loss_scale_manager": FixedLossScaleManager(128.0)}, "loss-scale manager"),
    ({"monitor": type("M", (), {"after_backward": lambda *a: None})()}, "monitor"),
    ({"cuda_graph": True}, "cuda_graph"),
])
def test_what_cannot_be_honoured_is_refused_before_anything_changes(kwargs, match):
    model = net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match=match):
        ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16", release_grads=True,
                                  master_weights="stochastic", **kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_other_optimizers_are_refused():
    model = net()
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="RMSprop"):
        ampgraph.build_train_step(model, F.cross_entropy, opt, "O2", "bf16", release_grads=True)


def hf_lm(kind: str) -> tuple[nn.Module, dict]:
    """A tiny HF causal LM (LLaMA: its own head; GPT-2: the head tied to the embedding) and
    its inputs, some labels ignored."""
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(
            hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
            intermediate_size=64, vocab_size=300))
    else:
        model = tf.GPT2LMHeadModel(tf.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300,
                                                 resid_pdrop=0, embd_pdrop=0, attn_pdrop=0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, ::3] = -100
    return model, {"input_ids": ids, "labels": labels}


def lean_and_default(kind: str, monkeypatch) -> tuple[dict, dict, list, list]:
    """Three steps each of memory="default" and memory="lean" from one model, the head's
    weight taken by blocks of 64 vocabulary rows: (models, losses, start, taken)."""
    import ampgraph.runtime.head_loss as head_loss

    monkeypatch.setattr(head_loss, "GRAD_BLOCK_BYTES", 4 * 32 * 64)
    models, losses, taken = {}, {}, []
    for memory in ("default", "lean"):
        model, inputs = hf_lm(kind)
        start = [p.detach().clone() for p in model.parameters()]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        step = ampgraph.build_train_step(model, None, opt, "O2", "bf16", memory=memory)
        if memory == "lean":
            take = step.released.take
            monkeypatch.setattr(step.released, "take", lambda p, a, g, take=take: (
                taken.append((p.shape, a, g.numel())), take(p, a, g)))
        losses[memory] = [float(step(**inputs).loss) for _ in range(3)]
        models[memory] = model
        if memory == "lean":
            assert step.released.stepped == len(start)
            assert all(p.grad is None for p in model.parameters())
    return models, losses, start, taken


def test_an_untied_head_is_stepped_by_blocks_of_its_vocabulary_in_its_own_backward(
        monkeypatch):
    models, losses, start, taken = lean_and_default("llama", monkeypatch)
    # five blocks of the 300 x 32 head (the last of 44 rows), each step
    assert taken == [((300, 32), i * 64 * 32, min(64, 300 - i * 64) * 32)
                     for i in range(5)] * 3
    # the streamed head's loss: an online log-sum-exp, within fp32 rounding; its input's
    # gradient takes one 16-bit rounding per block: the steps after it within bf16's
    assert losses["lean"][0] == pytest.approx(losses["default"][0], rel=1e-5)
    assert losses["lean"] == pytest.approx(losses["default"], rel=1e-3)
    # (measured: at most 5.5% of a parameter's change over three steps of lr 1e-2, where
    # Adam's normalised update turns tiny gradients' rounding into whole steps)
    for p, q, s in zip(models["default"].parameters(), models["lean"].parameters(), start):
        assert (p - q).norm() <= 0.1 * (p - s).norm()


def test_a_tied_head_is_not_taken_by_parts_and_trains_as_the_kept_step(monkeypatch):
    models, losses, _, taken = lean_and_default("gpt2", monkeypatch)
    assert taken == []  # the embedding reads the weight too: its gradient is summed whole
    assert losses["lean"] == losses["default"]
    for p, q in zip(models["default"].parameters(), models["lean"].parameters()):
        assert torch.equal(p, q)


def test_a_gradient_from_outside_the_op_that_took_it_by_parts_is_refused():
    from ampgraph.runtime.head_loss import linear_cross_entropy
    from ampgraph.train.release_grads import ReleasedGradients

    w = nn.Parameter(torch.randn(40, 8))
    x, target = torch.randn(6, 8).bfloat16(), torch.randint(0, 40, (6,))
    released = ReleasedGradients(torch.optim.SGD([w], lr=0.1), [w], torch.zeros(()))
    try:
        with released.stepping():
            # own_weight says nothing else reads w; here something does
            loss = linear_cross_entropy(x, w, None, target, own_weight=True) + w.sum()
            with pytest.raises(RuntimeError, match="from outside the op"):
                loss.backward()
    finally:
        released.remove()


def test_sixteen_bit_weights_stream_their_head_too(monkeypatch):
    import ampgraph.runtime.head_loss as head_loss

    monkeypatch.setattr(head_loss, "GRAD_BLOCK_BYTES", 4 * 32 * 64)
    model, inputs = hf_lm("llama")
    head = model.lm_head.weight.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step = ampgraph.build_train_step(model, None, opt, "O2", "bf16", memory="leanest")
    taken = []
    take = step.released.take
    monkeypatch.setattr(step.released, "take", lambda p, a, g: (
        taken.append((p.dtype, a, g.dtype)), take(p, a, g)))
    losses = [float(step(**inputs).loss) for _ in range(3)]
    assert losses[-1] < losses[0] and step.released.stepped == len(list(model.parameters()))
    assert taken == [(torch.bfloat16, i * 64 * 32, torch.bfloat16) for i in range(5)] * 3
    w = model.lm_head.weight
    assert w.dtype == torch.bfloat16 and w.grad is None
    moved = (w.float() - head).abs().amax(1)  # every block of rows stepped
    assert bool((moved > 0).all())
    state = opt.state[w]  # whole, in the weight's dtype, the step counted once a step
    assert state["exp_avg"].shape == w.shape and state["exp_avg"].dtype == torch.bfloat16
    assert float(state["step"]) == 3
