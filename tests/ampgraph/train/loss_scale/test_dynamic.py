"""ampgraph/train/loss_scale/dynamic.py: MindSpore's defaults but GradScaler's first scale,
GradScaler equivalence, floor, growth cap, state."""

from __future__ import annotations

import random

import pytest
import torch

from ampgraph.train.loss_scale import DynamicLossScaleManager
from tests.helpers import SyncCounter


def test_defaults_mindspore_but_grad_scalers_start():
    dyn = DynamicLossScaleManager()
    assert dyn.get_loss_scale() == 2.0**16  # GradScaler's: fp16 loses no first steps
    assert DynamicLossScaleManager(init_loss_scale=2**24).get_loss_scale() == 2.0**24
    assert (dyn.scale_factor, dyn.scale_window) == (2.0, 2000)
    assert dyn.get_drop_overflow_update() is True
    assert isinstance(dyn.get_loss_scale(), float)
    assert dyn.scale.dtype == torch.float32 and dyn.scale.dim() == 0


@pytest.mark.parametrize(
    "init_scale, window, p_overflow, seed",
    [(2.0**16, 7, 0.05, 0), (2.0**24, 1, 0.5, 1), (2.0**10, 50, 0.01, 2)],
)
def test_trajectory_equals_grad_scaler_for_10000_steps(init_scale, window, p_overflow, seed):
    rng = random.Random(seed)
    manager = DynamicLossScaleManager(init_scale, scale_factor=2, scale_window=window)
    scaler = torch.amp.GradScaler(
        "cpu", init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
        growth_interval=window,
    )
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=0.0)
    ours, theirs = [], []
    for _ in range(10_000):
        # random overflows, except at scale 1 (GradScaler has no floor and would go below)
        overflow = rng.random() < p_overflow and manager.get_loss_scale() > 1.0
        manager.update_loss_scale(overflow)
        ours.append(manager.get_loss_scale())
        scaler.scale(torch.ones(()))
        param.grad = torch.full((1,), float("inf") if overflow else 1.0)
        scaler.step(opt)
        scaler.update()
        theirs.append(scaler.get_scale())
    assert ours == theirs
    ups = sum(b > a for a, b in zip(ours, ours[1:]))
    downs = sum(b < a for a, b in zip(ours, ours[1:]))
    assert ups > 10 and downs > 10, "the pattern should exercise both growth and backoff"


def test_backoff_floor_is_one_and_window_restarts():
    m = DynamicLossScaleManager(init_loss_scale=4, scale_factor=2, scale_window=3)
    for expected in (2.0, 1.0, 1.0, 1.0):
        m.update_loss_scale(True)
        assert m.get_loss_scale() == expected
    m.update_loss_scale(False)
    m.update_loss_scale(False)
    m.update_loss_scale(True)  # restarts the clean-step count
    assert m.get_loss_scale() == 1.0 and int(m.growth_tracker) == 0
    for _ in range(2):
        m.update_loss_scale(False)
    assert m.get_loss_scale() == 1.0
    m.update_loss_scale(False)
    assert m.get_loss_scale() == 2.0 and int(m.growth_tracker) == 0


def test_growth_never_reaches_inf():
    m = DynamicLossScaleManager(init_loss_scale=2.0**127, scale_window=1)
    for _ in range(5):
        m.update_loss_scale(False)
    assert m.get_loss_scale() == 2.0**127


def test_non_power_of_two_factor():
    m = DynamicLossScaleManager(init_loss_scale=81, scale_factor=3, scale_window=2)
    m.update_loss_scale(True)
    assert m.get_loss_scale() == pytest.approx(27.0, rel=1e-6)
    m.update_loss_scale(False)
    m.update_loss_scale(False)
    assert m.get_loss_scale() == pytest.approx(81.0, rel=1e-6)


@pytest.mark.parametrize(
    "flag",
    [True, torch.tensor(True), torch.tensor(1.0), torch.tensor([1]), torch.tensor(float("inf"))],
)
def test_update_accepts_bool_and_tensors(flag):
    m = DynamicLossScaleManager(init_loss_scale=64)
    m.update_loss_scale(flag)
    assert m.get_loss_scale() == 32.0
    m.update_loss_scale(torch.tensor(0.0))
    assert m.get_loss_scale() == 32.0 and int(m.growth_tracker) == 1


def test_tensor_update_needs_no_host_sync():
    m = DynamicLossScaleManager(init_loss_scale=64, scale_window=2)
    flag = torch.zeros(())
    with SyncCounter() as counter:
        for i in range(6):
            flag.fill_(float(i % 3 == 0))
            m.update_loss_scale(flag)
        _ = m.scale * 2
    assert counter.syncs == 0


def test_update_rejects_bad_flags():
    m = DynamicLossScaleManager()
    with pytest.raises(ValueError, match="one-element tensor"):
        m.update_loss_scale(torch.zeros(2))
    with pytest.raises(ValueError, match="bool or a one-element tensor"):
        m.update_loss_scale("yes")


def test_dynamic_state_dict_resumes_exactly():
    rng = random.Random(3)
    pattern = [rng.random() < 0.2 for _ in range(400)]
    full = DynamicLossScaleManager(2.0**12, scale_window=5)
    first = DynamicLossScaleManager(2.0**12, scale_window=5)
    expected = []
    for flag in pattern:
        full.update_loss_scale(flag)
        expected.append(full.get_loss_scale())
    got = []
    for flag in pattern[:137]:
        first.update_loss_scale(flag)
        got.append(first.get_loss_scale())
    state = first.state_dict()
    assert set(state) == {"loss_scale", "scale_factor", "scale_window", "growth_tracker",
                          "min_loss_scale"}
    resumed = DynamicLossScaleManager()
    resumed.load_state_dict(state)
    for flag in pattern[137:]:
        resumed.update_loss_scale(flag)
        got.append(resumed.get_loss_scale())
    assert got == expected


def test_load_state_dict_keeps_tensor_identity():
    m = DynamicLossScaleManager()
    scale, tracker = m.scale, m.growth_tracker
    m.load_state_dict(DynamicLossScaleManager(32, scale_window=9).state_dict())
    assert m.scale is scale and m.growth_tracker is tracker
    assert m.get_loss_scale() == 32.0 and m.scale_window == 9


def test_repr_names_the_state():
    assert "scale_window=2000" in repr(DynamicLossScaleManager())


def test_min_loss_scale_floors_the_backoff_and_round_trips():
    from ampgraph import DynamicLossScaleManager

    m = DynamicLossScaleManager(init_loss_scale=2**10, min_loss_scale=2**7)
    for _ in range(10):
        m.update_loss_scale(True)
    assert m.get_loss_scale() == 2**7
    fresh = DynamicLossScaleManager()
    fresh.load_state_dict(m.state_dict())
    assert fresh.min_loss_scale == 2**7 and fresh.get_loss_scale() == 2**7
    with pytest.raises(ValueError, match="min_loss_scale"):
        DynamicLossScaleManager(init_loss_scale=4, min_loss_scale=8)
    with pytest.raises(ValueError, match="min_loss_scale"):
        DynamicLossScaleManager(min_loss_scale=0.5)


def _tiny_gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128,
                                     n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                                     attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def _lm_loss(out, ids):
    logits = out.logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning")
def test_fp16_default_skips_no_more_of_the_first_20_steps_than_grad_scaler():
    """The default dynamic scale loses no more of a small GPT-2's first 20 steps than
    GradScaler's default does; MindSpore's 2**24, chosen explicitly, loses some (so the
    count can tell the two apart)."""
    import copy

    from ampgraph import build_train_step

    model = _tiny_gpt2()
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 128, (4, 16), generator=g) for _ in range(20)]

    def ours(manager):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        step = build_train_step(m, _lm_loss, opt, "O2", "fp16", loss_scale_manager=manager)
        return sum(bool(step(ids, ids).overflow) for ids in batches)

    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaler_skipped = 0
    for ids in batches:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", torch.float16):
            loss = _lm_loss(m(ids), ids)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        scaler_skipped += scaler.get_scale() < before
    default = ours("auto")
    mindspore = ours(DynamicLossScaleManager(init_loss_scale=2**24))
    assert default <= scaler_skipped, (default, scaler_skipped, mindspore)
    assert mindspore > default, (default, scaler_skipped, mindspore)
