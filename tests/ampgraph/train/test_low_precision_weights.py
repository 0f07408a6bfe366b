"""16-bit weights: Kahan and stochastic-rounding updates reach fp32-master accuracy on digits
with <= 0.6x the bytes; plain bf16 updates are swamped and lose accuracy; the rules match
torch's SGD / AdamW in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampgraph.runtime.cpu.weights as weights
from ampgraph.train.low_precision_weights import (
    LowPrecisionUpdate,
    ModifiedMomentumSGD,
    convert_weights,
    state_bytes,
    stochastic_round_bf16,
)
from ampgraph.train.step import build_train_step

pytestmark = pytest.mark.usefixtures("one_thread")


def _digits():
    datasets = pytest.importorskip("sklearn.datasets")
    model_selection = pytest.importorskip("sklearn.model_selection")
    x, y = datasets.load_digits(return_X_y=True)
    xtr, xte, ytr, yte = model_selection.train_test_split(x, y, test_size=0.2, random_state=0,
                                                          stratify=y)
    f = lambda a: torch.tensor(a, dtype=torch.float32) / 16
    return f(xtr), torch.tensor(ytr), f(xte), torch.tensor(yte)


def _run(mode: str, data, epochs: int = 20, lr: float = 0.003) -> dict:
    xtr, ytr, xte, yte = data
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    step = build_train_step(model, F.cross_entropy, opt, "O2", "bf16", master_weights=mode)
    if step.weight_update is not None:
        step.weight_update.track_swamping = True
    order = torch.Generator().manual_seed(1)
    for _ in range(epochs):
        perm = torch.randperm(len(xtr), generator=order)
        for i in range(0, len(perm) - 31, 32):
            step(xtr[perm[i:i + 32]], ytr[perm[i:i + 32]])
    model.eval()
    with torch.no_grad():
        acc = (step.module(xte).argmax(1) == yte).float().mean().item() * 100
    # what the fp32-master run also keeps: the runtime's persistent bf16 working copies
    copies = step.module.working_copies()
    upd = step.weight_update
    return {"acc": acc, "bytes": state_bytes(model, opt, copies),
            "swamped": upd.swamped / upd.updated if upd else 0.0,
            "dtypes": {p.dtype for p in model.parameters()}}


@pytest.fixture(scope="module")
def runs():
    data = _digits()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # module-scoped: the one_thread fixture is not active yet
    try:
        with pytest.MonkeyPatch.context() as mp:
            # working copies kept between steps, as for layers of real size (this MLP's are
            # below the size from which the runtime keeps them)
            mp.setattr(weights, "KEPT_COPY_BYTES", 0)
            return {mode: _run(mode, data) for mode in ("fp32", "kahan", "stochastic", "none")}
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_16_bit_weights_match_fp32_masters_with_at_most_0_6x_bytes(runs, mode):
    ref, run = runs["fp32"], runs[mode]
    assert run["dtypes"] == {torch.bfloat16}
    assert abs(run["acc"] - ref["acc"]) <= 0.5, (run["acc"], ref["acc"])
    # counted from the tensors: params (+ the fp32 run's bf16 working copies), grads, state
    assert ref["bytes"]["per_param"] == 4 + 2 + 4 + 4
    assert run["bytes"]["per_param"] == {"kahan": 8, "stochastic": 6}[mode]
    assert run["bytes"]["total"] <= 0.6 * ref["bytes"]["total"]


def test_plain_bf16_updates_are_swamped_and_lose_accuracy(runs):
    plain = runs["none"]
    assert plain["swamped"] > 0.5
    assert plain["acc"] < runs["fp32"]["acc"] - 1.0, (plain["acc"], runs["fp32"]["acc"])
    assert plain["acc"] < min(runs["kahan"]["acc"], runs["stochastic"]["acc"])


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.5, dampening=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.1),
    lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.1),
])
def test_update_rules_equal_torch_in_fp32(make):
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(50))
    b = nn.Parameter(a.detach().clone())
    ours, theirs = make([a]), make([b])
    rule = LowPrecisionUpdate("kahan")
    for i in range(5):
        g = torch.randn(50, generator=torch.Generator().manual_seed(i))
        a.grad, b.grad = g.clone(), g.clone()
        rule(ours)  # fp32 parameters: the rule's own update, added exactly
        theirs.step()
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_kahan_and_stochastic_keep_tiny_updates_nearest_drops_them():
    out = {}
    for mode in ("kahan", "stochastic", "none"):
        p = nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
        opt = torch.optim.SGD([p], lr=2.0**-12)  # 1/32 of bf16's ulp at 1.0
        rule = LowPrecisionUpdate(mode, seed=0)
        for _ in range(64):
            p.grad = torch.ones_like(p)
            rule(opt)
        out[mode] = p.float().mean().item()
    assert out["none"] == 1.0
    assert out["kahan"] == pytest.approx(1 - 64 * 2.0**-12, abs=1e-3)
    assert out["stochastic"] == pytest.approx(1 - 64 * 2.0**-12, abs=2e-3)


def test_adamw_and_modified_sgd_train_in_bf16_with_norm_params_fp32():
    torch.manual_seed(0)
    x, y = torch.randn(64, 16), torch.randint(0, 4, (64,))
    for mode, make in (("kahan", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
                       ("stochastic", lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
                       ("none", lambda ps: ModifiedMomentumSGD(ps, lr=0.05))):
        model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Linear(32, 4))
        step = build_train_step(model, F.cross_entropy, make(model.parameters()), "O2", "bf16",
                                master_weights=mode)
        assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
        first = step(x, y).loss.item()
        for _ in range(30):
            last = step(x, y).loss.item()
        assert last < 0.7 * first, (mode, first, last)


def test_invalid_configurations_are_refused():
    m = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="master_weights must be one of"):
        build_train_step(m, F.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1), "O2", "bf16",
                         master_weights="fp16")
    with pytest.raises(ValueError, match="rounds into bf16"):
        build_train_step(m, F.mse_loss, torch.optim.SGD(m.parameters(), lr=0.1), "O2", "fp16",
                         master_weights="stochastic")
    with pytest.raises(ValueError, match="support torch.optim.SGD"):
        build_train_step(m, F.mse_loss, torch.optim.RMSprop(m.parameters()), "O2", "bf16",
                         master_weights="kahan")
    assert convert_weights(nn.LayerNorm(3), torch.bfloat16) == []
    x = torch.full((4096,), 1.0 + 2.0**-9)  # a quarter ulp above 1.0
    assert 0.2 < (stochastic_round_bf16(x) > 1).float().mean().item() < 0.3


@pytest.mark.parametrize("decay", [0.0, 0.1])
def test_a_large_parameter_is_updated_by_chunks_with_the_same_values(monkeypatch, decay):
    import ampgraph.train.low_precision_weights as lpw

    def run(chunk: int) -> tuple[torch.Tensor, dict]:
        monkeypatch.setattr(lpw, "UPDATE_CHUNK", chunk)
        g = torch.Generator().manual_seed(0)
        p = nn.Parameter(torch.randn(10, 30, generator=g).bfloat16())
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=decay)
        update = LowPrecisionUpdate("kahan")
        for _ in range(3):
            p.grad = torch.randn(10, 30, generator=g).bfloat16()
            update(opt)
        return p.detach(), opt.state[p]

    (whole, s1), (chunks, s2) = run(1 << 20), run(7)  # 300 elements: 43 chunks
    assert torch.equal(whole, chunks) and float(s1["step"]) == float(s2["step"]) == 3
    for key in ("exp_avg", "exp_avg_sq", "kahan_comp"):
        assert torch.equal(s1[key], s2[key]), key
