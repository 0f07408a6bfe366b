"""ampgraph/capture/numbers.py: numbers that take a second value become graph inputs."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from ampgraph.capture.numbers import (
    MAX_VALUES,
    Numbers,
    argument_name,
    as_numbers,
    as_tensors,
    given_as_tensors,
    number_positions,
)


def test_positions_are_floats_and_ints_not_bools():
    x = torch.ones(2)
    assert number_positions([x, 0.5, 3, True, None, "s"]) == (1, 2)


def test_a_number_becomes_symbolic_at_its_second_value_and_a_refused_one_is_bounded():
    x = torch.ones(2)
    numbers = Numbers()
    assert not numbers.note([x, 0.5]) and numbers.symbolic == frozenset()
    assert not numbers.note([x, 0.5]), "the same value again"
    assert numbers.note([x, 0.25]) and numbers.symbolic == {1}
    numbers.refuse(frozenset({1}))
    assert numbers.symbolic == frozenset() and not numbers.note([x, 0.125])
    spec = pytree.tree_flatten(((x, 0.1), {}))[1]
    for _ in range(MAX_VALUES):
        assert numbers.constant_capture("the model", [x, 0.1], spec)
    with pytest.warns(UserWarning, match="8 values of positional argument 1"):
        assert not numbers.constant_capture("the model", [x, 0.1], spec)
    assert not numbers.constant_capture("the model", [x, 0.1], spec), "warned once"


def test_round_trip_through_tensors_keeps_the_values_and_types():
    args, kwargs = (torch.ones(2), 0.1), {"n": 3, "flag": True}
    leaves, spec = pytree.tree_flatten((args, kwargs))
    positions = number_positions(leaves)
    targs, tkwargs = as_tensors(args, kwargs, positions)
    assert targs[1].dtype == torch.float64 and tkwargs["n"].dtype == torch.int64
    assert tkwargs["flag"] is True
    back = as_numbers(targs, tkwargs, positions)
    assert back[0][1] == 0.1 and back[1]["n"] == 3
    stood = given_as_tensors(leaves, positions)
    assert [type(v).__name__ for v in stood] == ["Tensor", "Tensor", "Tensor", "bool"]
    assert argument_name(spec, leaves, positions[1]) == "`n`"
