"""build_train_step: generated code, overflow handling, loss scaling, syncs, state, options."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampgraph
import ampgraph.train.step_runtime as step_runtime
from ampgraph.train.adaptive_scale import AdaptiveLossScaleManager
from ampgraph.train.loss_scale import DynamicLossScaleManager, FixedLossScaleManager
from ampgraph.train.step import build_train_step
from tests.helpers import SyncCounter

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]
INF, NAN = float("inf"), float("nan")




def mlp(seed: int = 0, hidden: int = 32) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def batch(i: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g)


def snapshot(module: nn.Module, opt: torch.optim.Optimizer) -> tuple[list, dict]:
    params = [p.detach().clone() for p in module.parameters()]
    return params, copy.deepcopy(opt.state_dict()["state"])


def same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    for k in a:
        if a[k].keys() != b[k].keys():
            return False
        for name in a[k]:
            if not torch.equal(torch.as_tensor(a[k][name]), torch.as_tensor(b[k][name])):
                return False
    return True


@pytest.fixture(scope="module")
def bf16_net():
    """One compiled bf16 MLP shared by the tests (captured once); reset per test."""
    model = mlp()
    net = ampgraph.compile(model, "O2", "bf16")
    initial = copy.deepcopy(model.state_dict())
    net.load_state_dict(initial)
    yield net
    net.load_state_dict(initial)


@pytest.fixture()
def net(bf16_net):
    bf16_net.load_state_dict(mlp().state_dict())
    return bf16_net


OPTIMIZERS = {
    "sgd_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
    "sgd_fused_momentum": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, fused=True),
}


def _inject(kind: str, net: nn.Module, armed: list[bool]):
    """(loss_fn, input transform, hook handle) that make step k non-finite when armed."""
    weight = next(net.parameters())  # the first Linear's weight
    handle = None
    if kind in ("grad_inf", "grad_nan"):
        value = INF if kind == "grad_inf" else NAN
        handle = weight.register_hook(lambda g: torch.full_like(g, value) if armed[0] else g)

    def loss_fn(out, y):
        loss = F.cross_entropy(out, y)
        if armed[0] and kind in ("loss_inf", "loss_nan"):
            loss = loss + (INF if kind == "loss_inf" else NAN)  # gradients stay finite
        return loss

    def inputs(x):
        if armed[0] and kind == "input_inf":
            x = x.clone()
            x[0, 0] = INF
        return x

    return loss_fn, inputs, handle


@pytest.mark.parametrize(
    "kind, opt_name",
    [(k, "adam") for k in ("grad_inf", "grad_nan", "loss_inf", "loss_nan", "input_inf")]
    + [("grad_inf", o) for o in ("sgd_momentum", "adam_fused", "sgd_fused_momentum")],
)
@pytest.mark.parametrize("k", [0, 3])
def test_injected_nonfinite_skips_the_step_and_backs_off(net, kind, opt_name, k):
    opt = OPTIMIZERS[opt_name](net.parameters())
    manager = DynamicLossScaleManager(init_loss_scale=2.0**10, scale_window=1000)
    armed = [False]
    loss_fn, inputs, handle = _inject(kind, net, armed)
    step = build_train_step(net, loss_fn, opt, loss_scale_manager=manager)
    try:
        for i in range(k + 4):
            x, y = batch(i)
            armed[0] = i == k
            before = snapshot(net, opt)
            out = step(inputs(x), y)
            after = snapshot(net, opt)
            changed = any(not torch.equal(a, b) for a, b in zip(before[0], after[0]))
            if i == k:
                assert out.overflow is True and out.loss_scale == 2.0**10
                assert not changed, "parameters changed on an overflow step"
                if k == 0 and opt_name == "adam_fused":  # fused: zero state is created
                    assert all(t.count_nonzero() == 0 for s in after[1].values()
                               for t in s.values())
                else:
                    assert same_state(before[1], after[1])
                assert manager.get_loss_scale() == 2.0**9
            else:
                assert out.overflow is False and torch.isfinite(out.loss)
                assert changed
                assert all(torch.isfinite(p).all() for p in net.parameters())
        if k == 0 and opt_name == "sgd_fused_momentum":  # no garbage momentum after a skip
            ref = mlp()
            ref_net = ampgraph.compile(ref, "O2", "bf16")
            ref_opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
            for i in range(1, 4):
                ref_opt.zero_grad()
                F.cross_entropy(ref_net(batch(i)[0]), batch(i)[1]).backward()
                ref_opt.step()
            for p, q in zip(net.parameters(), ref.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    finally:
        if handle is not None:
            handle.remove()


def test_loss_scaling_rescues_underflow():
    """A tiny fp16 loss: all-zero gradients at scale 1, FP32's gradients when scaled."""
    x, y = batch(0)
    tiny = lambda out, target: F.cross_entropy(out, target) * 1e-7  # |dL/dlogit| < 6e-9
    grads = {}
    for name, level, manager in [
        ("fp32", "O0", None),
        ("scale1", "O2", FixedLossScaleManager(1.0)),
        ("dynamic", "O2", DynamicLossScaleManager()),
    ]:
        model = mlp()
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        step = build_train_step(model, tiny, opt, level, "fp16", loss_scale_manager=manager)
        out = step(x, y)
        assert out.overflow is False
        grads[name] = [p.grad.clone() for p in model.parameters()]
    assert all(torch.count_nonzero(g) == 0 for g in grads["scale1"])
    for ref, got in zip(grads["fp32"], grads["dynamic"]):
        assert torch.count_nonzero(ref) > 0
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-3 * ref.abs().max().item())




@pytest.mark.parametrize(
    "opt_name, manager, expected",
    [
        ("sgd_momentum", lambda: DynamicLossScaleManager(2.0**8, scale_window=2), 1),
        ("adam_fused", lambda: DynamicLossScaleManager(2.0**8, scale_window=2), 0),
        ("sgd_momentum", lambda: FixedLossScaleManager(8.0, drop_overflow_update=False), 0),
        ("sgd_momentum", lambda: None, 1),
    ],
)
def test_host_syncs_per_step(net, monkeypatch, opt_name, manager, expected):
    fetches = []
    real = step_runtime.to_host
    monkeypatch.setattr(step_runtime, "to_host", lambda t: fetches.append(1) or real(t))
    opt = OPTIMIZERS[opt_name](net.parameters())
    step = build_train_step(net, F.cross_entropy, opt, loss_scale_manager=manager(),
                            clip_grad_norm=1.0)
    step(*batch(0))  # warm-up (optimizer state creation)
    fetches.clear()
    with SyncCounter() as counter:
        outs = [step(*batch(i)) for i in range(1, 6)]
    assert (len(fetches) + counter.syncs) == expected * 5
    assert (expected == 0) == ("to_host" not in step.code)
    scales = [o.loss_scale for o in outs]  # lazy outputs fetch now, correctly
    assert all(o.overflow is False for o in outs) and all(s >= 1.0 for s in scales)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")
def test_no_device_sync_with_fused_adam_on_cuda():
    model = mlp().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True)
    step = build_train_step(model, F.cross_entropy, opt, "O2", "fp16")
    data = [tuple(t.cuda() for t in batch(i)) for i in range(4)]
    step(*data[0])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = [step(*d) for d in data[1:]]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(isinstance(o.loss_scale, float) for o in outs)


def _step_code(net, **kwargs) -> str:
    opt = kwargs.pop("optimizer", None) or torch.optim.SGD(net.parameters(), lr=0.1)
    return build_train_step(net, F.cross_entropy, opt, **kwargs).code


def test_code_is_specialised(net):
    plain = _step_code(net, loss_scale_manager=None)
    for absent in ("clip_grad_norm_", "all_reduce", "manager", "micro", "no_sync", "monitor"):
        assert absent not in plain
    full = _step_code(net, loss_scale_manager=DynamicLossScaleManager(), clip_grad_norm=1.0,
                      accumulation_steps=4, monitor=type("M", (), {"after_backward": print})())
    for present in ("clip_grad_norm_(params, 1.0", "(loss / 4 * scale).backward()",
                    "manager.update_loss_scale(found_inf)", "micro != 3", "monitor.after_backward",
                    "_amp_foreach_non_finite_check_and_unscale_", "to_host"):
        assert present in full
    fixed = _step_code(net, loss_scale_manager=FixedLossScaleManager(16.0))
    assert "manager.scale" in fixed and "update_loss_scale" not in fixed
    fused = _step_code(net, optimizer=torch.optim.AdamW(net.parameters(), fused=True))
    assert "optimizer.found_inf = found_inf" in fused and "to_host" not in fused
    compile(full, "<check>", "exec")


def test_auto_loss_scale_manager():
    sgd = lambda m: torch.optim.SGD(m.parameters(), lr=0.1)
    m = mlp()
    auto16 = build_train_step(m, F.cross_entropy, sgd(m), "O2", "fp16").loss_scale_manager
    assert isinstance(auto16, DynamicLossScaleManager) and auto16.get_loss_scale() == 2.0**16
    m = mlp()
    assert build_train_step(m, F.cross_entropy, sgd(m), "O2", "bf16").loss_scale_manager is None
    m = mlp()
    assert build_train_step(m, F.cross_entropy, sgd(m), "O0").loss_scale_manager is None
    m = mlp()
    fixed = FixedLossScaleManager(4.0)
    explicit = build_train_step(m, F.cross_entropy, sgd(m), "O2", "bf16",
                                loss_scale_manager=fixed)
    assert explicit.loss_scale_manager is fixed
    m = mlp()
    assert build_train_step(m, F.cross_entropy, sgd(m), "O2", "fp16",
                            loss_scale_manager=None).loss_scale_manager is None


def test_compile_kwargs_are_forwarded_and_the_loss_sees_fp32():
    seen = []

    def loss_fn(out, y):
        seen.append(out.dtype)
        return F.cross_entropy(out, y)

    model = mlp()
    step = build_train_step(model, loss_fn, torch.optim.SGD(model.parameters(), lr=0.1), "O2",
                            "bf16", keep_io_types=False)
    assert step.module.amp_config.keep_io_types is False and "cast_fp32(" in step.code
    assert step(*batch(0)).loss.dtype == torch.float32 and seen == [torch.float32]


def test_gradient_accumulation_equals_one_big_batch():
    x, y = batch(0, n=32)
    big, small = mlp(), mlp()
    step_big = build_train_step(big, F.cross_entropy, torch.optim.SGD(big.parameters(), lr=0.5),
                                "O0")
    step_small = build_train_step(small, F.cross_entropy,
                                  torch.optim.SGD(small.parameters(), lr=0.5), "O0",
                                  accumulation_steps=4)
    for _ in range(2):
        assert step_big(x, y).stepped
        flags = [step_small(x[i:i + 8], y[i:i + 8]).stepped for i in range(0, 32, 8)]
        assert flags == [False, False, False, True]
        assert step_small.step_index == step_big.step_index
    for p, q in zip(big.parameters(), small.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_clipping_bounds_the_unscaled_gradient_norm(net):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = build_train_step(net, F.cross_entropy, opt, clip_grad_norm=0.01,
                            loss_scale_manager=DynamicLossScaleManager(2.0**12))
    out = step(*batch(0))
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()]))
    assert out.grad_norm > 0.01 and total <= 0.01 * (1 + 1e-4)


def test_clipping_with_a_manager_that_observes_gradients(net):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)  # not fused: one host sync decides
    step = build_train_step(net, F.cross_entropy, opt, clip_grad_norm=0.01,
                            loss_scale_manager=AdaptiveLossScaleManager())
    out = step(*batch(0))
    total = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in net.parameters()]))
    assert out.stepped and not out.overflow
    assert out.grad_norm > 0.01 and total <= 0.01 * (1 + 1e-4)


@dataclasses.dataclass
class Output:
    loss: torch.Tensor | None
    logits: torch.Tensor


class LossModel(nn.Module):
    def __init__(self, mode: str) -> None:
        super().__init__()
        self.body, self.mode = mlp(), mode

    def forward(self, x, labels=None):
        logits = self.body(x)
        if self.mode == "vector":
            return F.cross_entropy(logits, labels, reduction="none")
        loss = None if labels is None else F.cross_entropy(logits, labels)
        return loss if self.mode == "tensor" else Output(loss=loss, logits=logits)


@pytest.mark.parametrize("mode", ["tensor", "dataclass", "vector"])
def test_model_returning_its_loss(mode):
    model = LossModel(mode)
    step = build_train_step(model, None, torch.optim.Adam(model.parameters(), lr=1e-2), "O2",
                            "bf16")
    if mode == "vector":
        with pytest.raises(ValueError, match="one-element tensor"):
            step(*batch(0)[:1], labels=batch(0)[1])
        return
    losses = [step(x, labels=y).loss.item() for x, y in [batch(0)] * 8]
    assert losses[-1] < losses[0]
    loss, overflow, scale = step(*batch(0)[:1], labels=batch(0)[1])
    assert loss.dtype == torch.float32 and overflow is False and scale == 1.0
    if mode == "dataclass":
        with pytest.raises(ValueError, match="pass labels"):
            step(batch(0)[0])


def test_compiled_model_is_not_compiled_again(net, monkeypatch):
    monkeypatch.setattr(ampgraph, "compile", lambda *a, **k: pytest.fail("compiled twice"))
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = build_train_step(net, F.cross_entropy, opt)
    assert step.module is net and step.network is net and step.amp_level == "O2"
    assert build_train_step(net, F.cross_entropy, opt, "O2", "bf16").amp_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="compiled at amp_level='O2'.*amp_level='O3'"):
        build_train_step(net, F.cross_entropy, opt, amp_level="O3")
    with pytest.raises(ValueError, match="compiled with dtype bf16"):
        build_train_step(net, F.cross_entropy, opt, dtype="fp16")
    with pytest.raises(ValueError, match="pass them to ampgraph.compile"):
        build_train_step(net, F.cross_entropy, opt, keep_batchnorm_fp32=False)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"accumulation_steps": 0}, "accumulation_steps must be an integer >= 1"),
        ({"clip_grad_norm": -1.0}, "clip_grad_norm must be None or a finite number > 0"),
        ({"loss_scale_manager": "dynamic"}, "loss_scale_manager must be 'auto', None"),
        ({"optimizer": "other"}, "holds none of the model's parameters"),
    ],
)
def test_invalid_arguments(net, kwargs, match):
    opt = torch.optim.SGD(mlp().parameters() if kwargs.pop("optimizer", None)
                          else net.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        build_train_step(net, F.cross_entropy, opt, **kwargs)


def test_monitor_hook_runs_on_stepping_calls(net):
    calls = []

    class Monitor:
        def after_backward(self, step_index, module, optimizer, loss_scale, overflow):
            calls.append((step_index, module, optimizer, float(loss_scale), float(overflow)))

    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    step = build_train_step(net, F.cross_entropy, opt, accumulation_steps=2, monitor=Monitor(),
                            loss_scale_manager=FixedLossScaleManager(32.0))
    for i in range(6):
        step(*batch(i))
    assert [c[0] for c in calls] == [0, 1, 2]
    assert all(c[1] is net and c[2] is opt and c[3:] == (32.0, 0.0) for c in calls)
    assert "monitor" not in _step_code(net, monitor=object())


def test_state_dict_mismatched_manager_is_an_error(net):
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with_manager = build_train_step(net, F.cross_entropy, opt,
                                    loss_scale_manager=DynamicLossScaleManager())
    without = build_train_step(net, F.cross_entropy, opt, loss_scale_manager=None)
    with pytest.raises(ValueError, match="same loss_scale_manager"):
        without.load_state_dict(with_manager.state_dict())
