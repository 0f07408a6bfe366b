"""The properties every fuzzed FX program must have, as one function for tests and the soak.

:func:`check_fx_program` compiles a :class:`~tests.reliability.strategies.Program` two ways
(the FX passes on ``torch.export(...).module()``, and ``ampgraph.compile``) and checks:

- invariants: ``graph.lint()`` and the verify pass; the pass is idempotent (a second run
  changes nothing); the compiled module never falls back to eager;
- casts: none to the value's own dtype, no ``low -> fp32 -> low`` round trip, one cast per
  (producer, dtype), none at O0;
- policy: at O1/O2 every deny-list op runs fp32 and reads its float inputs in their original
  dtype; at O1-O3 every allow-list op runs low (range hazards excepted); at O3 everything
  runs low except what the fp16/bf16 range analysis kept fp32;
- numerics: outputs fp32, finite wherever FP32 is finite, and within :func:`tolerance` of
  FP32 (relative L2 error), unless a discrete decision reads a rounded value (structure and
  finiteness only, see docs/reliability.md);
- compiling the compiled module again returns it (same options) or raises ValueError.

Known, still open library bugs are raised as :class:`KnownBug` so the property tests can set
those examples aside while strict-xfail tests pin the bugs (none is open today).
"""

from __future__ import annotations

import collections
import re
import warnings
from dataclasses import dataclass

import torch
from torch import fx

import ampgraph
from passes.fx import run_amp_passes, verify
from passes.fx.dtypes import dtype_of, is_amp_cast
from passes.fx.nodes import FLOATS, op_key
from passes.fx.policy import fixed_slots, make_policy
from passes.policy import ALLOW, DENY, FP32, LOW, NA, LevelPolicy
from tests.reliability.strategies import FuzzNet, Program, example_inputs

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
TOLERANCE_ULPS = 32
FP16_HEADROOM = 2e4
# Errors are relative to max(|output|, FLOOR_FRACTION x the largest value the program makes).
FLOOR_FRACTION = 0.05
# Parameter gradients smaller than this (in L2) come from saturated programs (a softmax
# of nearly equal values ...): 16-bit backward passes lose them without loss scaling,
# which build_train_step supplies; their numerics are not compared.
GRAD_FLOOR = 1e-2  # programs whose FP32 values exceed this are out of fp16 range by design


def tolerance(dtype: torch.dtype) -> float:
    """Relative L2 error allowed against FP32: 32 units of roundoff of the low dtype.

    bf16: 0.125, fp16: 0.0156. Typical errors are a few units; the margin covers programs
    that normalise a difference of nearly equal values (catastrophic cancellation). The soak
    run's maxima are in docs/reliability.md.
    """
    return TOLERANCE_ULPS * UNIT_ROUNDOFF[dtype]


class KnownBug(Exception):
    """A failure matching a library bug already pinned by a strict-xfail test."""


def known_bug(exc: BaseException) -> str | None:
    """The name of the known, still open library bug ``exc`` shows, or None.

    None is open today. When the fuzzer finds a bug that is not fixed at once, return a
    name here for its signature and pin it with a minimal strict-xfail test, so the property
    tests set such examples aside (``reject()``) and keep checking everything else.
    """
    del exc
    return None


@dataclass
class FxOutcome:
    """What one checked case showed (the soak run aggregates these)."""

    rel_err: float  # largest relative L2 error over the outputs (0.0 at O0)
    numerics_checked: bool
    casts: int


def known_numerics_bug(program: Program, dtype: torch.dtype | str) -> str | None:
    """The known, still open bug a numerics failure of ``program`` shows, or None (none
    today; see :func:`known_bug`)."""
    del program, dtype
    return None


def _known(program: Program, dtype: torch.dtype | str, check, *args):
    try:
        return check(*args)
    except AssertionError:
        name = known_numerics_bug(program, dtype)
        if name is not None:
            raise KnownBug(name) from None
        raise


def _call(fn, *args):
    try:
        return fn(*args)
    except Exception as exc:
        name = known_bug(exc)
        if name is not None:
            raise KnownBug(name) from exc
        raise


def check_fx_program(program: Program, level: str, dtype: torch.dtype) -> FxOutcome:
    """Run every property on one program; raise AssertionError (or KnownBug) on a violation."""
    net = FuzzNet(program).eval()
    x, y = example_inputs(program)
    with torch.no_grad():
        ref = net(x, y)
    magnitude = net.max_magnitude(x, y)
    in_range = dtype != torch.float16 or magnitude < FP16_HEADROOM
    floor = FLOOR_FRACTION * magnitude
    numerics = in_range and not program.discrete_on_computed

    gm = torch.export.export(net, (x, y), strict=False).module()
    policy = make_policy(level)
    result = _call(run_amp_passes, gm, policy, dtype)
    gm.graph.lint()
    verify(gm, dtype)
    check_casts(gm, level)
    assert result.casts == sum(map(is_amp_cast, gm.graph.nodes))
    check_policy(gm, level)
    low = dtype if level != "O0" else torch.float32
    with torch.no_grad():
        out = _call(gm, x, y)
    rel = _known(program, dtype, check_outputs, ref, out, low, numerics, floor)

    net_c = ampgraph.compile(net, level, dtype)
    with torch.no_grad():
        out_c = _call(net_c, x, y)
    _check_not_eager(net_c)
    rel = max(rel, _known(program, dtype, check_outputs, ref, out_c, low, numerics, floor))
    assert sum(is_amp_cast(n) + ("amp_fused_weight_cast" in n.meta)  # a linear's own casts
               + ("amp_fused_bias_cast" in n.meta)
               for n in net_c._amp_last.gm.graph.nodes) == result.casts
    check_compile_twice(net_c, level, dtype)
    x3, y3 = example_inputs(program, batch=3)  # a new batch size reuses the dynamic graph
    with torch.no_grad():
        _known(program, dtype, check_outputs, net(x3, y3), _call(net_c, x3, y3), low, numerics,
               floor)
    assert len(net_c._amp_graphs) == 1, "a new batch size captured a second graph"
    check_idempotent(gm, policy, dtype, result.casts)
    return FxOutcome(rel, numerics, result.casts)


def check_idempotent(gm: fx.GraphModule, policy: LevelPolicy, dtype: torch.dtype,
                     casts: int) -> None:
    """A second run of the passes on their own output changes nothing."""
    before = _graph_signature(gm)
    again = run_amp_passes(gm, policy, dtype)
    assert again.casts == casts and _graph_signature(gm) == before, \
        "a second run of the passes changed the graph"



def _check_not_eager(net_c: torch.nn.Module) -> None:
    assert net_c._amp_eager is None, f"fell back to eager: {net_c._amp_eager_reason}"


def _graph_signature(gm: fx.GraphModule) -> list:
    return [(n.op, str(n.target), n.meta.get("amp_dtype")) for n in gm.graph.nodes]


def _source(node: fx.Node) -> fx.Node:
    while is_amp_cast(node):
        node = node.args[0]
    return node


def _orig_dtype(node: fx.Node) -> torch.dtype | None:
    src = _source(node)
    return src.meta.get("amp_orig_dtype", dtype_of(src))


def check_casts(gm: fx.GraphModule, level: str) -> None:
    """No no-op casts, no low->fp32->low round trips, one cast per (producer, dtype)."""
    casts = [n for n in gm.graph.nodes if is_amp_cast(n)]
    if level == "O0":
        assert not casts, f"O0 inserted casts: {[c.name for c in casts]}"
    seen = collections.Counter()
    for c in casts:
        src, target = c.args[0], c.kwargs["dtype"]
        assert dtype_of(src) != target, f"{c.name} casts {src.name} to its own dtype {target}"
        if is_amp_cast(src):
            inner = src.args[0]
            assert not (dtype_of(src) == torch.float32 and dtype_of(inner) == target), \
                f"redundant cast pair {inner.name} -> {src.name} -> {c.name} ({target})"
        key = src.target if src.op == "get_attr" else src
        seen[(key, target)] += 1
    dupes = {k: v for k, v in seen.items() if v > 1}
    assert not dupes, f"several casts of one value to one dtype: {dupes}"


def _float_inputs(node: fx.Node) -> list[tuple[int | str, fx.Node]]:
    out = []
    for slot, a in [*enumerate(node.args), *node.kwargs.items()]:
        for n in a if isinstance(a, (list, tuple)) else [a]:
            if isinstance(n, fx.Node) and _orig_dtype(n) in FLOATS:
                out.append((slot, n))
    return out


def check_policy(gm: fx.GraphModule, level: str) -> None:
    """Deny ops fp32 at O1/O2, allow ops low at O1-O3, everything low at O3."""
    if level == "O0":
        return
    policy = make_policy(level)
    for node in gm.graph.nodes:
        if node.op != "call_function" or is_amp_cast(node):
            continue
        if node.meta.get("amp_precision", NA) == NA:  # integer/bool results, sources
            continue
        key = op_key(node)
        cls = policy.op_info(key).cls
        precision, reason = node.meta["amp_precision"], node.meta.get("amp_reason", "")
        hazard = re.search(r"\b(fp16|bf16) range\b", reason) is not None  # range analysis
        where = f"{node.name} ({key}, {precision}: {reason})"
        if cls == DENY and level in ("O1", "O2"):
            assert precision == FP32, f"deny-list op not fp32 at {level}: {where}"
            for slot, a in _float_inputs(node):
                if slot == 0 and "amp_io" in node.meta:  # fp32 norm fed low (fusions.py)
                    assert dtype_of(a) == node.meta["amp_io"], where
                    continue
                assert dtype_of(a) == _orig_dtype(a), \
                    f"deny-list op {where} reads {a.name} as {dtype_of(a)} at {level}"
        if cls == ALLOW and not hazard:
            assert precision == LOW, f"allow-list op not low at {level}: {where}"
            for slot, a in _float_inputs(node):
                if slot not in fixed_slots(key) and _orig_dtype(a) == torch.float32:
                    assert dtype_of(a) in (torch.bfloat16, torch.float16), \
                        f"allow-list op {where} reads {a.name} as {dtype_of(a)}"
        if level == "O3" and precision == FP32:
            assert hazard, f"fp32 op at O3: {where}"


def check_outputs(ref: tuple, out: tuple, dtype: torch.dtype, numerics: bool,
                  floor: float = 0.0) -> float:
    """fp32, finite where FP32 is finite, and (if ``numerics``) close; return the error.

    The error is relative to the output's L2 norm, or to ``floor`` (an RMS value: a fraction
    of the largest value the program computes) when the output is smaller than that: an
    output that cancels to almost nothing carries the rounding of the values it came from.
    """
    assert len(ref) == len(out)
    worst = 0.0
    for r, o in zip(ref, out):
        assert o.dtype == r.dtype == torch.float32, f"output dtype {o.dtype}"
        assert o.shape == r.shape
        finite = torch.isfinite(r)
        assert torch.isfinite(o[finite]).all(), "non-finite output where FP32 is finite"
        err = (o[finite] - r[finite]).double().norm()
        n = max(finite.sum().item(), 1) ** 0.5
        scale = max(float(r[finite].double().norm()), max(floor, 1e-3) * n)
        rel = float(err) / scale
        worst = max(worst, rel)
        if numerics:
            assert rel <= tolerance(dtype), \
                f"relative L2 error {rel:.4g} > {tolerance(dtype):.4g} ({dtype})"
    return worst


def check_compile_twice(net_c: torch.nn.Module, level: str, dtype: torch.dtype) -> None:
    """Same options: the same module back (no double casts). Others: ValueError."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert ampgraph.compile(net_c, level, dtype) is net_c
        other = "O1" if level != "O1" else "O2"
        try:
            ampgraph.compile(net_c, other, dtype)
        except ValueError as exc:
            assert "already compiled" in str(exc) and "original_module" in str(exc)
        else:
            raise AssertionError("compiling a compiled module at another level did not raise")


def check_fx_training(program: Program, level: str, dtype: torch.dtype) -> float | None:
    """Train mode: a forward/backward through the compiled module gives every parameter
    FP32 gives a gradient a finite fp32 gradient, updates the same running statistics, and
    (when the numerics are checked) gradients within tolerance; return the gradient error
    (None when it was not compared: discrete decisions, or gradients under GRAD_FLOOR).
    """
    ref_net = FuzzNet(program).train()
    amp_net = FuzzNet(program).train()  # same seed: same weights
    x, y = example_inputs(program)
    numerics = not program.discrete_on_computed and (
        dtype != torch.float16 or ref_net.max_magnitude(x, y) < FP16_HEADROOM)
    ref_net.load_state_dict(amp_net.state_dict())  # max_magnitude ran a train-mode forward

    def loss_of(outputs: tuple) -> torch.Tensor:
        return sum((o.float() * torch.linspace(-1, 1, o.shape[-1])).sum() for o in outputs)

    ref_loss = loss_of(ref_net(x, y))
    net_c = ampgraph.compile(amp_net, level, dtype)
    amp_loss = _call(lambda: loss_of(net_c(x, y)))
    _check_not_eager(net_c)
    assert ref_loss.requires_grad == amp_loss.requires_grad
    if ref_loss.requires_grad:
        ref_loss.backward()
        amp_loss.backward()
    return _known(program, dtype, _compare_training, ref_net, amp_net, numerics,
                  tolerance(dtype if level != "O0" else torch.float32))


def _compare_training(ref_net: FuzzNet, amp_net: FuzzNet, numerics: bool,
                      tol: float) -> float | None:
    ref_grads, amp_grads = [], []
    for (name, p), q in zip(ref_net.named_parameters(), amp_net.parameters()):
        assert (p.grad is None) == (q.grad is None), f"{name}: gradient presence differs"
        if p.grad is None:
            continue
        assert q.grad.dtype == torch.float32, f"{name}: gradient dtype {q.grad.dtype}"
        if torch.isfinite(p.grad).all():
            assert torch.isfinite(q.grad).all(), f"{name}: non-finite gradient"
        ref_grads.append(p.grad.flatten())
        amp_grads.append(q.grad.flatten())
    for (name, b), c in zip(ref_net.named_buffers(), amp_net.buffers()):
        if b.is_floating_point():
            torch.testing.assert_close(c, b, rtol=0.05, atol=0.05, msg=f"buffer {name}")
        else:
            assert torch.equal(b, c), f"buffer {name}"
    if not ref_grads:
        return None
    r, a = torch.cat(ref_grads).double(), torch.cat(amp_grads).double()
    if not numerics or float(r.norm()) < GRAD_FLOOR:
        return None
    rel = float((a - r).norm() / float(r.norm()))
    assert rel <= 2 * tol, f"gradient relative L2 error {rel:.4g}"
    return rel
