"""Faithfulness: non-tensor arguments (capture/numbers.py), calls the eager model rejects too
(they raise eager's error and leave the model compiled), and torch.compile of a compiled
module (its graphs stay ampgraph's)."""

from __future__ import annotations

import pytest
import torch

from tests.ampgraph.faithfulness.harness import MLP, Case, check, compiled_whole, graphs, inputs


class Timed(MLP):
    """A diffusion-style float argument and an int one."""

    def forward(self, x, t: float = 0.0, repeat: int = 1, flip: bool = False):
        h = self.act(self.a(x)) * (1.0 + t) + t * 0.1
        out = self.b(h).repeat(1, repeat)
        return -out if flip else out


class Branching(MLP):
    def forward(self, x, t: float):
        out = super().forward(x)
        return out * 2 if t > 0.5 else out


def float_per_call(call, model):
    with torch.no_grad():
        return [call(inputs(), 0.05 * i) for i in range(20)]


def int_per_call(call, model):
    with torch.no_grad():
        return [call(inputs(), 0.0, r) for r in (1, 2, 3, 2, 1)]


def keyword_float(call, model):
    with torch.no_grad():
        return [call(inputs(), t=0.1 * i) for i in range(5)]


def bool_flag(call, model):
    with torch.no_grad():
        return [call(inputs(), 0.0, 1, f) for f in (False, True, False, True)]


def branching(call, model):
    with torch.no_grad():
        return [call(inputs(), 0.04 * i) for i in range(20)]


def errors(bad):
    def scenario(call, model):
        first = call(inputs())
        try:
            bad(call)
            caught = None
        except Exception as exc:  # noqa: BLE001 - compared with eager's
            caught = (type(exc).__name__, str(exc).splitlines()[0])
        return [first, caught, call(inputs(seed=5))]
    return scenario


def bad_first(call, model):
    try:
        call(torch.randn(4, 9))
        caught = None
    except Exception as exc:  # noqa: BLE001
        caught = (type(exc).__name__, str(exc).splitlines()[0])
    return [caught, call(inputs())]


def compiled_by_torch(first_call_before: bool):
    def scenario(call, model):
        out = [call(inputs())] if first_call_before else []
        fast = torch.compile(call)
        return out + [fast(inputs()), fast(inputs(seed=3)), fast(inputs(n=6))]
    return scenario


def bounded(n):
    def after(net):
        compiled_whole(net)
        assert graphs(net) <= n, graphs(net)
    return after


def still_compiled(net):
    bounded(1)(net)
    assert net.compiled_for((inputs(),), {}) is not None


CASES = [
    Case("a float argument changing every call (a timestep)", Timed, float_per_call,
         after=bounded(2)),
    Case("an int argument changing", Timed, int_per_call, after=bounded(3)),
    Case("a float keyword argument", Timed, keyword_float, after=bounded(2)),
    Case("a bool flag argument", Timed, bool_flag, after=bounded(2)),
    Case("a float the model branches on", Branching, branching,
         warns="took 8 values of positional argument 1"),
    Case("a wrong input width", MLP, errors(lambda call: call(torch.randn(4, 9))),
         after=still_compiled),
    Case("a wrong input dtype", MLP, errors(lambda call: call(torch.ones(4, 8, dtype=torch.long))),
         after=still_compiled),
    Case("a wrong keyword", MLP, errors(lambda call: call(inputs(), scale=2)),
         after=still_compiled),
    Case("a wrong input on the very first call", MLP, bad_first, after=still_compiled),
    Case("torch.compile of the compiled module before its first call", MLP,
         compiled_by_torch(False), after=bounded(1)),
    Case("torch.compile of the compiled module after its first call", MLP,
         compiled_by_torch(True), after=bounded(1)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_arguments(case):
    check(case)


def test_a_failed_call_prints_no_torch_logs(capfd):
    import ampgraph

    net = ampgraph.compile(MLP(), "O2", "bf16")
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        net(torch.randn(4, 9))
    assert capfd.readouterr().err == ""
