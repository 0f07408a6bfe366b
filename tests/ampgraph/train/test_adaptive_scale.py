"""AdaptiveLossScaleManager: hysteresis and floor, underflow-driven growth, recovery after an
overflow burst (vs GradScaler defaults), per-layer scales in the graph, exact state round trip."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampgraph.train.adaptive_scale import FP16_TINY, AdaptiveLossScaleManager
from ampgraph.train.loss_scale import DynamicLossScaleManager
from ampgraph.train.step import build_train_step
from tests.helpers import SyncCounter

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
]


def test_hysteresis_backs_off_only_on_consecutive_overflows_and_floor_holds():
    m = AdaptiveLossScaleManager(2.0**4, min_loss_scale=2.0, hysteresis=3)
    seen = []
    for overflow in (1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 0, 1):
        m.update_loss_scale(bool(overflow))
        seen.append(m.get_loss_scale())
    #        1   1   0   1   1   1(3rd) 1  1(floor) 1   1   0   1
    assert seen == [16, 16, 16, 16, 16, 8, 4, 2, 2, 2, 2, 2]
    assert m.state_dict()["hysteresis_left"] == 2  # one overflow since the clean step
    with pytest.raises(ValueError, match="hysteresis"):
        AdaptiveLossScaleManager(hysteresis=0)
    with pytest.raises(ValueError, match="min_loss_scale <= init_loss_scale"):
        AdaptiveLossScaleManager(1.0, min_loss_scale=2.0)


def test_growth_is_amax_bounded_and_needs_underflow():
    p = nn.Parameter(torch.zeros(100))
    m = AdaptiveLossScaleManager(1.0, underflow_threshold=0.01)
    grad = torch.full((100,), 1e-3)
    grad[:2] = 1e-7  # 2% below 2**-14 at scale 1
    p.grad = grad.clone()
    m.observe_gradients([p], torch.zeros(()))
    m.update_loss_scale(False)
    # largest 2**k with 1e-3 * 2**k <= 65504 / 256
    assert m.get_loss_scale() == 2.0**17
    p.grad = grad.clone()
    m.observe_gradients([p], torch.zeros(()))
    m.update_loss_scale(False)  # now 1e-7 * 2**17 > 2**-14: no underflow, no growth
    assert m.get_loss_scale() == 2.0**17
    m.observe_gradients([p], torch.zeros(()))
    m.update_loss_scale(True)  # statistics of an overflowing step never grow the scale
    assert m.get_loss_scale() == 2.0**17


def test_state_round_trips_exactly():
    m = AdaptiveLossScaleManager(3.0 * 2**10, min_loss_scale=3.0, hysteresis=4,
                                 underflow_threshold=0.125)
    m.update_loss_scale(True)
    sd = m.state_dict()
    other = AdaptiveLossScaleManager()
    other.load_state_dict(copy.deepcopy(sd))
    assert other.state_dict() == sd
    for _ in range(5):
        m.update_loss_scale(True)
        other.update_loss_scale(True)
        assert m.get_loss_scale() == other.get_loss_scale()


BASELINE_SYNCS = 0  # the counter sees .item()/bool(); the step's one to_host(info) is a tolist()


def _digits_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def _data():
    datasets = pytest.importorskip("sklearn.datasets")
    x, y = datasets.load_digits(return_X_y=True)
    return torch.tensor(x[:640], dtype=torch.float32) / 16, torch.tensor(y[:640])


def _true_underflow(model, step_grads, scale, x, y):
    """Fraction of the fp32 gradient's non-zero elements that are zero or below fp16's
    smallest normal in the fp16 step's gradient at its scale."""
    ref = copy.deepcopy(model).float()
    ref.zero_grad()
    F.cross_entropy(ref(x), y).backward()
    bad = total = 0
    for p, g in zip(ref.parameters(), step_grads):
        nz = p.grad != 0
        bad += int((nz & ((g * scale).abs() < FP16_TINY)).sum())
        total += int(nz.sum())
    return bad / total


@pytest.mark.parametrize("name", ["adaptive", "dynamic"])
def test_recovers_from_an_overflow_burst_where_grad_scaler_defaults_stall(name):
    x, y = _data()
    model = _digits_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    manager = (AdaptiveLossScaleManager() if name == "adaptive"
               else DynamicLossScaleManager(2.0**16, 2, 2000))  # GradScaler's defaults
    step = build_train_step(model, F.cross_entropy, opt, "O2", "fp16",
                            loss_scale_manager=manager)
    for i in range(10):
        step(x[i * 32:(i + 1) * 32], y[i * 32:(i + 1) * 32])
    for _ in range(25):  # a burst of corrupt batches: the forward itself overflows
        out = step(x[:32] * 1e6, y[:32])
        assert out.overflow
    assert manager.get_loss_scale() == 1.0
    for i in range(50):
        j = i % 20
        with SyncCounter() as syncs:
            out = step(x[j * 32:(j + 1) * 32], y[j * 32:(j + 1) * 32])
        assert syncs.syncs <= BASELINE_SYNCS, syncs.syncs
    grads = [p.grad.clone() for p in model.parameters()]
    frac = _true_underflow(model, grads, out.loss_scale, x[j * 32:(j + 1) * 32],
                           y[j * 32:(j + 1) * 32])
    if name == "adaptive":
        assert frac < 0.01, (frac, out.loss_scale)
    else:
        assert out.loss_scale == 1.0 and frac > 0.01, (frac, out.loss_scale)


class TwoBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(32, 8)
        self.b = nn.Linear(32, 8)

    def forward(self, x):
        return self.a(x), self.b(x)


def _two_branch_loss(out, y):  # two tasks whose gradients are 2**20 apart
    return F.cross_entropy(out[0], y) * 2.0**12 + F.cross_entropy(out[1], y) * 2.0**-8


@pytest.mark.parametrize("per_layer", [False, True])
def test_per_layer_trains_branches_2_pow_20_apart_without_underflow(per_layer):
    torch.manual_seed(0)
    x, y = torch.randn(64, 32), torch.randint(0, 8, (64,))
    model = TwoBranch()
    first = copy.deepcopy(model)
    opt = torch.optim.SGD([{"params": model.a.parameters(), "lr": 2.0**-14},
                           {"params": model.b.parameters(), "lr": 2.0**6}])
    manager = AdaptiveLossScaleManager(per_layer=per_layer)
    step = build_train_step(model, _two_branch_loss, opt, "O2", "fp16",
                            loss_scale_manager=manager)
    for _ in range(30):
        out = step(x, y)
    assert not out.overflow
    ref = copy.deepcopy(model).float()
    F.cross_entropy(ref.a(x), y).mul(2.0**12).add(
        F.cross_entropy(ref.b(x), y).mul(2.0**-8)).backward()
    scales = manager.layer_scales or {"a": out.loss_scale, "b": out.loss_scale}
    under = {}
    for branch in ("a", "b"):
        mod, rmod = getattr(model, branch), getattr(ref, branch)
        nz = rmod.weight.grad != 0
        scaled = (mod.weight.grad * scales[branch]).abs()
        assert torch.isfinite(scaled).all() and scaled.max() < 65504
        under[branch] = float((nz & (scaled < FP16_TINY)).sum() / nz.sum())
    if per_layer:
        assert under == {"a": 0.0, "b": 0.0}, (under, scales)
        for branch in ("a", "b"):  # both branches learn
            before = F.cross_entropy(getattr(first, branch)(x), y)
            after = F.cross_entropy(getattr(model, branch)(x), y)
            assert after < before - 0.05, branch
    else:
        assert under["b"] > 0.01, (under, scales)  # one global scale cannot serve both
