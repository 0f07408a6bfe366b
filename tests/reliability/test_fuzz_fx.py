"""Property-based tests of the FX pass and ``ampgraph.compile`` on random DAG models.

Programs come from ``strategies.fx_programs`` (matmul, conv, norms, softmax, elementwise,
reshapes, cat/split, integer ops feeding gather/embedding/where, branches, shared weights);
``fx_checks`` holds the properties. The README suite runs a bounded, derandomized number of
examples; ``AMPGRAPH_FUZZ_EXAMPLES=N`` raises it (benchmarks/soak.py runs thousands).

Examples hitting a known, still open library bug (``KnownBug``, see ``fx_checks.known_bug``)
are set aside with ``reject()``; none is open today. The tests after the property tests pin
the bugs the fuzzer found (all fixed since) as regression tests.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, reject, settings
from hypothesis import strategies as st
from torch import nn

import ampgraph
from passes.fx import run_amp_passes
from passes.fx.policy import make_policy
from tests.reliability.fx_checks import KnownBug, check_fx_program, check_fx_training
from tests.reliability.strategies import DTYPES, LEVELS, fx_programs

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:ampgraph.*it is clamped to"),  # mask fills
]


def examples(default: int) -> int:
    """Examples per property: ``default`` in the README suite, more for a soak."""
    return int(os.environ.get("AMPGRAPH_FUZZ_EXAMPLES", default))


FUZZ = dict(deadline=None, derandomize=True, database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])




CASES = [(level, dtype) for dtype in DTYPES for level in LEVELS]


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{lv}-{str(dt)[6:]}" for lv, dt in CASES])
@settings(max_examples=examples(12), **FUZZ)
@given(data=st.data())
def test_random_models_compile_correctly(case, data):
    """lint + verify, cast hygiene, deny ops fp32 at O1/O2, allow ops low, numerics against
    FP32, compile-twice is a no-op or ValueError, dynamic batch, idempotent passes."""
    level, dtype = CASES[case]
    program = data.draw(fx_programs(rotate=case), label="program")
    try:
        check_fx_program(program, level, dtype)
    except KnownBug:
        reject()


@pytest.mark.parametrize("case", range(len(CASES)),
                         ids=[f"{lv}-{str(dt)[6:]}" for lv, dt in CASES])
@settings(max_examples=examples(3), **FUZZ)
@given(data=st.data())
def test_random_models_train(case, data):
    """Train mode: finite fp32 gradients for the same parameters as FP32, close to FP32's,
    and the same BatchNorm running statistics."""
    level, dtype = CASES[case]
    program = data.draw(fx_programs(rotate=case + len(CASES)), label="program")
    try:
        check_fx_training(program, level, dtype)
    except KnownBug:
        reject()


# -- known bugs found by the fuzzer, pinned by minimal tests --------------------------------


class FlattenThenLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.flatten(1).view(-1, 2, 8))  # two data-movement ops on the input


def test_o2_chain_of_data_ops_on_an_input_is_painted():
    """Found by the fuzzer: paint._follow raised KeyError at O2 when a CLEAR op was fed only
    by a CLEAR op fed only by sources (fixed; kept as a regression test)."""
    x = torch.randn(2, 2, 8)
    gm = torch.export.export(FlattenThenLinear(), (x,), strict=False).module()
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)


def test_o2_chain_of_data_ops_does_not_fall_back_to_eager():
    """The same KeyError made ampgraph.compile fall back to eager fp32 for the whole model."""
    net = ampgraph.compile(FlattenThenLinear(), "O2", "bf16")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        net(torch.randn(2, 2, 8))
    assert not [w for w in record if "could not be captured" in str(w.message)]
    assert net._amp_eager is None


class FinfoMinMask(nn.Module):
    """HuggingFace-style masking with torch.finfo(torch.float32).min."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.qk(x)
        scores = (h @ h.transpose(1, 2)).masked_fill(mask, torch.finfo(torch.float32).min)
        return torch.softmax(scores, -1)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_bf16_finfo_min_mask_fill(level):
    """Regression test (found by the fuzzer, since fixed): masked_fill(low, mask, finfo(fp32).min)
    runs in bf16 and raises: -3.4028e38 is below bf16's lowest -3.3895e38."""
    torch.manual_seed(0)
    model = FinfoMinMask().eval()
    x = torch.randn(2, 4, 8)
    mask = torch.zeros(2, 4, 4, dtype=torch.bool)
    mask[:, :, -1] = True
    with torch.no_grad():
        out = ampgraph.compile(model, level, "bf16")(x, mask)
        ref = model(x, mask)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


class MaskFill(nn.Module):
    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x.masked_fill(mask, -1e9), -1)


def test_passes_are_idempotent_with_fp16_saturation():
    """Regression test (found by the fuzzer, since fixed): a second run of the FX passes on their
    own fp16 output adds a second clamp before each saturated mask fill."""
    x, mask = torch.randn(2, 4), torch.zeros(2, 4, dtype=torch.bool)
    gm = torch.export.export(MaskFill(), (x, mask), strict=False).module()
    policy = make_policy("O3")
    run_amp_passes(gm, policy, torch.float16)
    before = [(n.op, str(n.target)) for n in gm.graph.nodes]
    run_amp_passes(gm, policy, torch.float16)
    assert [(n.op, str(n.target)) for n in gm.graph.nodes] == before


class ScaledLinear(nn.Module):
    """A large scale factor through a matmul and back: fp32 never leaves [-10, 10]."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x * 1e5) * 1e-5


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_fp16_large_scale_factor_through_a_matmul(level):
    """Regression test (found by the fuzzer, since fixed): fp16 range analysis stops one op after
    an out-of-range constant: fc(x * 1e5) stays fp32, its ~1e5 result is cast to fp16 for the
    next op and overflows to inf."""
    torch.manual_seed(0)
    model = ScaledLinear().eval()
    x = torch.randn(2, 8)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        ref, out = model(x), ampgraph.compile(model, level, "fp16")(x)
    assert torch.isfinite(ref).all()
    assert torch.isfinite(out).all(), "inf where FP32 is finite"
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_fp16_clamp_of_a_mask_fill_warns():
    """Regression test (found by the fuzzer, since fixed): the FX pass clamps a -inf stand-in
    (finfo.min mask) to -65504 before an fp16 cast silently; the ONNX pass warns
    (ConstantRangeWarning) and issue 8 asks for a warning."""
    from tests.passes.fx.test_hazards import AdditiveMaskSDPA

    torch.manual_seed(0)
    keep = torch.ones(2, 4, dtype=torch.long)
    keep[1, 2:] = 0
    net = ampgraph.compile(AdditiveMaskSDPA().eval(), "O2", "fp16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        net(torch.randn(2, 4, 8), keep)
    assert any("clamp" in str(w.message) for w in caught)
    assert any(n.target is torch.ops.aten.clamp.default for n in net._amp_last.gm.graph.nodes)
