"""Float8Products: FP8 products within FP8's error, gradients, one weight conversion per
step without host syncs, the emulation equal to ``torch._scaled_mm``, torch.compile.

Error bounds. e4m3 keeps 3 mantissa bits: rounding a normal number errs by at most half
an ulp, 2**-4 relative; uniformly spread over that range the RMS relative error is at most
2**-4/sqrt(3) (0.036) per operand (e5m2, 2 bits: 2**-3/sqrt(3), 0.072). The two operands'
errors are independent, so for random operands a product's relative Frobenius error is
the root sum of squares: at most sqrt(2) * 2**-4/sqrt(3) = 0.051 for e4m3 x e4m3 and
sqrt(0.072**2 + 0.036**2) = 0.081 for e5m2 x e4m3 (the bf16 output adds 2**-9).
"""

from __future__ import annotations

import gc
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ampgraph.runtime.fp8 import Float8Products, weight_copies

E4M3_BOUND = math.sqrt(2) * 2**-4 / math.sqrt(3)
E5M2_BOUND = math.hypot(2**-3 / math.sqrt(3), 2**-4 / math.sqrt(3))
SYNC_OPS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal"}


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref.double()).norm() / ref.double().norm()).item()


def cosine(got: torch.Tensor, ref: torch.Tensor) -> float:
    return F.cosine_similarity(got.double().flatten(), ref.double().flatten(), dim=0).item()


def operands(m=64, k=128, n=96, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.nn.Parameter(torch.randn(n, k, generator=g) / k**0.5)
    b = torch.nn.Parameter(torch.randn(n, generator=g))
    return x, w, b


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_within_fp8_error_of_float64(scaling, dtype):
    x, w, b = operands(dtype=dtype)
    out = Float8Products().linear(x, w, b, scaling=scaling)
    ref = x.double() @ w.double().t() + b.double()
    assert out.dtype == dtype and out.shape == (64, 96)
    err = rel_err(out - b.detach().to(dtype), ref - b.double())
    # FP8 (not 16-bit) rounding happened, and stayed within its bound
    assert 2**-7 < err < E4M3_BOUND, err


def test_rowwise_keeps_small_rows_accurate():
    """Rows 2**-12..2**12 apart: one tensor scale pushes small rows into e4m3's
    subnormals; a scale per row keeps each row within the bound."""
    x, w, _ = operands(dtype=torch.float32)
    x = (x * 2.0 ** torch.randint(-12, 13, (64, 1)).float()).to(torch.bfloat16)
    ref = x.double() @ w.double().t()
    rows = {s: Float8Products().linear(x, w, scaling=s) for s in ("tensorwise", "rowwise")}
    worst = {s: max(rel_err(o[i], ref[i]) for i in range(64)) for s, o in rows.items()}
    assert worst["rowwise"] < E4M3_BOUND * 1.5 < worst["tensorwise"], worst


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("weight_grad", ["fp8", "low"])
@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_gradients_match_the_bf16_product(scaling, weight_grad, transposed):
    x, w, b = operands()
    x = x.reshape(4, 16, 128).requires_grad_()
    if transposed:
        w = torch.nn.Parameter(w.detach().t().contiguous())
    out = Float8Products().linear(x, w, b, transposed=transposed, scaling=scaling,
                                  weight_grad=weight_grad)
    assert out.shape == (4, 16, 96)
    g = torch.randn(out.shape).to(out.dtype)
    grads = torch.autograd.grad(out, (x, w, b), g)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    wl = wr.to(torch.bfloat16)
    ref = (xr @ wl if transposed else F.linear(xr, wl)) + br.to(torch.bfloat16)
    refs = torch.autograd.grad(ref, (xr, wr, br), g)
    assert [t.dtype for t in grads] == [torch.bfloat16, torch.float32, torch.float32]
    assert [t.shape for t in grads] == [t.shape for t in refs]
    grad_bound = E5M2_BOUND if scaling == "tensorwise" else E4M3_BOUND
    w_bound = grad_bound if weight_grad == "fp8" else 2**-6
    for name, got, want, bound in zip(("x", "weight", "bias"), grads, refs,
                                      (grad_bound, w_bound, 2**-6)):
        assert cosine(got, want) > 0.99, name
        assert rel_err(got, want) < bound, (name, rel_err(got, want))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("a_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_emulation_is_scaled_mm(scaling, a_dtype):
    from ampgraph.runtime.fp8 import _quantize, _scaled_mm  # the product itself

    x, w, _ = operands(m=32, k=64, n=48)
    rowwise = scaling == "rowwise"
    a, inv_a = _quantize(x, a_dtype, -1 if rowwise else None)
    b, inv_b = _quantize(w.detach(), torch.float8_e4m3fn, -1 if rowwise else None)
    inv_b = inv_b.t()
    real = torch._scaled_mm(a, b.t(), inv_a, inv_b, out_dtype=torch.bfloat16).float()
    emulated = _scaled_mm(a, b.t(), inv_a, inv_b, torch.bfloat16, emulate=True).float()
    # the same product up to the bf16 output's rounding (accumulation order may differ)
    assert (emulated - real).abs().le(real.abs() * 2**-8 + 1e-6).all()
    assert _scaled_mm(a, b.t(), inv_a, inv_b, torch.bfloat16, emulate=False).equal(
        real.to(torch.bfloat16))


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_scaled_mm_path_matches_emulation_end_to_end(scaling):
    """emulate=False (``torch._scaled_mm``, slow on the CPU: tiny shapes) gives the
    emulation's outputs and gradients; 20 tokens pad the weight gradient's inner dim."""
    x, w, b = operands(m=20, k=32, n=48)
    x.requires_grad_()
    results = []
    for emulate in (False, True):
        out = Float8Products(emulate=emulate).linear(x, w, b, scaling=scaling)
        results.append((out, *torch.autograd.grad(out, (x, w, b), torch.ones_like(out))))
    for real, emulated in zip(*results):
        assert rel_err(real, emulated) < 2**-7


class CountOps(TorchDispatchMode):
    def __init__(self, weight_shape):
        super().__init__()
        self.weight_shape = weight_shape
        self.conversions = 0
        self.syncs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name == "_to_copy" and kwargs.get("dtype") == torch.float8_e4m3fn and \
                tuple(args[0].shape) == self.weight_shape:
            self.conversions += 1
        if name in SYNC_OPS:
            self.syncs.append(name)
        return func(*args, **kwargs)


class Float8Casts(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.casts = []  # (dtype, shape) of every conversion to FP8

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.overloadpacket.__name__ == "_to_copy" and kwargs.get("dtype") in (
                torch.float8_e4m3fn, torch.float8_e5m2):
            self.casts.append((kwargs["dtype"], tuple(args[0].shape)))
        return func(*args, **kwargs)


@pytest.mark.parametrize("scaling, grad_dtype", [("tensorwise", torch.float8_e5m2),
                                                 ("rowwise", torch.float8_e4m3fn)])
def test_output_gradient_dtype(scaling, grad_dtype):
    """e5m2 for tensorwise gradients; e4m3 rowwise (the rowwise kernels take e4m3 only)."""
    x, w, _ = operands(m=16, k=64, n=32)
    out = Float8Products().linear(x.requires_grad_(), w, scaling=scaling)
    with Float8Casts() as mode:
        out.backward(torch.ones_like(out))
    assert {c for c in mode.casts if c[1] == (16, 32)} == {(grad_dtype, (16, 32))}


@pytest.mark.parametrize("cache", [True, False])
@pytest.mark.parametrize("fused", [False, True])
def test_one_weight_conversion_per_step_and_no_host_sync(fused, cache):
    x, w, b = operands(m=16, k=64, n=32)
    fp8 = Float8Products(cache_weights=cache)
    opt = torch.optim.AdamW([w, b], lr=0.1, fused=fused)
    for _ in range(3):
        with CountOps((32, 64)) as counts:
            h = fp8.linear(x, w, b)  # the same weight used twice in a step
            loss = (h.float().square().sum() + fp8.linear(x, w).float().sum())
            loss.backward()
        opt.step()
        opt.zero_grad()
        assert counts.conversions == (1 if cache else 2)
        assert counts.syncs == []
    assert fp8.conversions == (3 if cache else 0)


def test_cache_sees_updates_and_lets_weights_die():
    x, w, _ = operands(m=16, k=64, n=32)
    fp8 = Float8Products()
    first = fp8.weight_copies(w, "rowwise", False)
    assert fp8.weight_copies(w, "rowwise", False) is first
    with torch.no_grad():
        w.mul_(2)
    again = fp8.weight_copies(w, "rowwise", False)
    assert again is not first and again[1].equal(first[1] * 2) and again[0].equal(first[0])
    assert len(fp8._entries) == 1
    del w, first, again
    gc.collect()
    assert fp8._entries == {}


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_weight_copies_layouts(scaling):
    w = torch.randn(48, 32)
    w_fwd, inv, w_bwd, inv_t = weight_copies(w, scaling, False)
    assert w_fwd.shape == (48, 32) and w_bwd.shape == (32, 48) and w_bwd.is_contiguous()
    assert w_fwd.dtype == w_bwd.dtype == torch.float8_e4m3fn
    assert torch.log2(inv).frac().eq(0).all()  # powers of two
    deq = w_fwd.float() * (inv.t() if scaling == "rowwise" else inv)
    assert rel_err(deq, w) < 2**-4
    same = weight_copies(w.t().contiguous(), scaling, True)
    assert all(a.equal(b) for a, b in zip(same, (w_fwd, inv, w_bwd, inv_t)))


def test_bad_arguments_say_what_is_allowed():
    x, w, _ = operands(m=16, k=64, n=32)
    with pytest.raises(ValueError, match="scaling must be one of"):
        Float8Products().linear(x, w, scaling="blockwise")


def compiled_or_skip(fn, *args):
    torch._dynamo.reset()
    try:
        return torch.compile(fn, backend="inductor", fullgraph=True)(*args)
    except Exception as error:  # noqa: BLE001 - the reason goes to the skip message
        pytest.skip(f"inductor cannot compile the FP8 product on this CPU: {error!r}"[:300])


@pytest.mark.parametrize("scaling", ["rowwise"])
def test_torch_compile_matches_eager(scaling):
    """cache_weights=False traces whole (fullgraph): the amax, scale and casts compiled."""
    x, w, b = operands(m=16, k=32, n=48)
    fp8 = Float8Products(cache_weights=False)
    compiled = compiled_or_skip(lambda x, w, b: fp8.linear(x, w, b, scaling=scaling), x, w, b)
    assert compiled.equal(fp8.linear(x, w, b, scaling=scaling))


@pytest.mark.slow
def test_torch_compile_training_matches_eager():
    x, w, b = operands(m=16, k=32, n=48)
    fp8 = Float8Products(cache_weights=False)

    def step(x, w, b):
        return fp8.linear(x, w, b, scaling="rowwise").float().square().sum()

    xs = [x.clone().requires_grad_() for _ in range(2)]
    eager = step(xs[0], w, b)
    eager_grads = torch.autograd.grad(eager, (xs[0], w, b))
    compiled = compiled_or_skip(step, xs[1], w, b)
    compiled_grads = torch.autograd.grad(compiled, (xs[1], w, b))
    assert rel_err(compiled, eager) < 2**-7
    for got, want in zip(compiled_grads, eager_grads):
        assert rel_err(got, want) < 2**-6
