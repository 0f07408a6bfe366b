"""The faithfulness suite's harness: every case runs one scenario three ways and compares.

A :class:`Case` builds a small model (the same weights each time) and plays a scenario on
it, as a user would: calls, training steps, a flag changed after the first call, a hook
registered, a wrong input. The scenario returns what it observed: outputs, gradients,
what its hooks and side effects collected, the errors it caught. :func:`check` plays it on
the eager fp32 model, under ``torch.autocast`` (bf16) and through
``ampgraph.compile(model, "O2", "bf16")``, and requires of ampgraph's observations:

- every tensor is within bf16 tolerance of fp32's: its relative error is at most three
  times autocast's, or ``case.tolerance`` (a lost backward, a sign flip, a stale graph are
  errors of order 1);
- every other value (a count, a type, an error message, a ``None`` gradient) equals
  fp32's;
- ampgraph's warnings are the ones the case expects, and only those: a difference it
  announces is allowed where the case says so, a silent one never.

``case.after(net)`` checks what only the compiled module can tell (how many graphs, what
``explain`` says), on the ampgraph run.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import ampgraph

LOW = torch.bfloat16


@dataclass(frozen=True)
class Case:
    """One everyday thing a user does; see the module docstring."""

    name: str
    build: Callable[[], nn.Module]
    scenario: Callable[[Callable[..., Any], nn.Module], list]
    warns: str | None = None  # every ampgraph warning must match it (None: no warning)
    tolerance: float = 2e-2  # relative error always allowed
    after: Callable[[nn.Module], None] | None = None  # checks on the compiled module

    def __str__(self) -> str:
        return self.name


class Autocast(nn.Module):
    """The model called under ``torch.autocast("cpu", bf16)``, as a user would; its
    parameters are the model's, under the model's names (``functional_call`` on it works)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        for name in ("_parameters", "_buffers", "_modules"):
            self.__dict__[name] = model.__dict__[name]
        self.__dict__["model"] = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast("cpu", LOW):
            return self.model(*args, **kwargs)


def observe(case: Case, mode: str) -> tuple[list, list[str], Any]:
    """The scenario's observations in ``mode`` ("fp32", "autocast", "ampgraph"), the
    ampgraph warnings it raised, and what was called."""
    torch.manual_seed(0)
    model = case.build()
    if mode == "ampgraph":
        call = ampgraph.compile(model, "O2", "bf16")
    elif mode == "autocast":
        call = Autocast(model)
    else:
        call = model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(1)
        values = list(case.scenario(call, model))
    said = [str(w.message) for w in caught if str(w.message).startswith("ampgraph")]
    return values, said, call


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / (want.norm() + 1e-6))


def check(case: Case) -> None:
    """Play ``case`` three ways and compare (see the module docstring)."""
    fp32, _, _ = observe(case, "fp32")
    auto, _, _ = observe(case, "autocast")
    amp, said, net = observe(case, "ampgraph")
    assert len(amp) == len(fp32), f"{case}: {len(amp)} observations, eager made {len(fp32)}"
    for i, (a, f, c) in enumerate(zip(amp, fp32, auto)):
        where = f"{case}: observation {i}"
        if isinstance(f, torch.Tensor):
            assert isinstance(a, torch.Tensor), f"{where}: {type(a).__name__}, eager: a tensor"
            assert a.shape == f.shape, f"{where}: shape {tuple(a.shape)}, eager {tuple(f.shape)}"
            err, auto_err = relative_error(a, f), relative_error(c, f)
            assert err <= max(3 * auto_err, case.tolerance), (
                f"{where}: relative error {err:.3g} vs fp32 (autocast's {auto_err:.3g})")
        else:
            assert not isinstance(a, torch.Tensor) and a == f, f"{where}: {a!r}, eager {f!r}"
    if case.warns is None:
        assert said == [], f"{case}: unexpected ampgraph warnings {said}"
    else:
        assert said, f"{case}: expected a warning matching {case.warns!r}"
        for text in said:
            assert re.search(case.warns, text), f"{case}: warning {text!r}"
    if case.after is not None:
        case.after(net)


# -- pieces the cases share ------------------------------------------------------------------


class MLP(nn.Module):
    """Two linears around an activation: the smallest model with a low-precision product."""

    def __init__(self, d_in: int = 8, d: int = 16, d_out: int = 4) -> None:
        super().__init__()
        self.a = nn.Linear(d_in, d)
        self.act = nn.GELU()
        self.b = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.act(self.a(x)))


def inputs(n: int = 4, d: int = 8, seed: int = 2) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def grads(model: nn.Module) -> list:
    """Each parameter's gradient (a copy), None where it has none."""
    return [None if p.grad is None else p.grad.clone() for p in model.parameters()]


def step(call: Callable[..., Any], model: nn.Module, *args: Any) -> list:
    """One forward and backward of a sum loss: the output and every gradient."""
    model.zero_grad(set_to_none=True)
    out = call(*args)
    out.float().sum().backward()
    return [out.detach(), *grads(model)]


def graphs(net: nn.Module) -> int:
    """How many graphs the compiled module holds."""
    return sum(len(v) for v in net._amp_graphs.values())


def compiled_whole(net: nn.Module) -> None:
    assert net._amp_eager is None, f"fell back to eager: {net._amp_eager_reason}"
