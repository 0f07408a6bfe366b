"""passes/_infra.py: PassManager names the pass and the node of any failure."""

from __future__ import annotations

import functools
import warnings

import pytest
import torch
from torch import fx

from passes._infra import (
    ConstantRangeWarning,
    PassError,
    PassInputError,
    PassManager,
    PassResult,
    failing_node,
    named,
    pass_name,
)


def small_graph() -> fx.GraphModule:
    g = fx.Graph()
    x = g.placeholder("x")
    h = g.call_function(torch.relu, (x,), name="relu")
    y = g.call_function(torch.neg, (h,), name="neg")
    g.output(y)
    return fx.GraphModule(torch.nn.Module(), g)


def lookup_by_op(gm: fx.GraphModule) -> PassResult:
    """A pass with a bug: a KeyError inside its loop over the nodes, at node ``neg``."""
    table = {"placeholder": 0, "output": 2, "relu": 1}
    for node in gm.graph.nodes:
        if node.op == "call_function":
            table[node.name]
    return PassResult(gm, False)


def untouched(gm: fx.GraphModule) -> PassResult:
    return PassResult(gm, False)


def touched(gm: fx.GraphModule) -> PassResult:
    return PassResult(gm, True)


def test_a_keyerror_in_a_loop_over_nodes_names_the_pass_and_the_node():
    gm = small_graph()
    with pytest.raises(PassError) as info:
        PassManager([untouched, lookup_by_op, touched]).run(gm)
    err = info.value
    assert err.pass_name == "lookup_by_op" and err.node == "neg"
    assert str(err) == "[lookup_by_op] at node 'neg': KeyError: 'neg'"
    assert isinstance(err.__cause__, KeyError)


def test_the_innermost_frame_with_a_node_names_it():
    def helper(node_list):
        for node in node_list:  # innermost: names "relu" though the caller is at "neg"
            raise ValueError(node.name)

    def outer(gm):
        for node in gm.graph.nodes:
            if node.name == "neg":
                helper([node.prev])
        return PassResult(gm, False)

    with pytest.raises(PassError) as info:
        PassManager([named("outer", outer)]).run(small_graph())
    assert (info.value.pass_name, info.value.node) == ("outer", "relu")


def test_a_failure_outside_any_node_names_no_node():
    def empty(gm):
        raise RuntimeError("nothing to do")

    with pytest.raises(PassError) as info:
        PassManager([empty]).run(small_graph())
    assert info.value.node is None
    assert str(info.value) == "[empty]: RuntimeError: nothing to do"
    assert failing_node(None) is None


def test_pass_errors_and_escalated_warnings_pass_through_unchanged():
    original = PassError("verify", "conv", "input 0 is bf16, expected fp32")

    def raises(gm):
        raise original

    with pytest.raises(PassError) as info:
        PassManager([raises]).run(small_graph())
    assert info.value is original

    def warns(gm):
        warnings.warn("clamped", ConstantRangeWarning, stacklevel=1)
        return PassResult(gm, True)

    with warnings.catch_warnings():
        warnings.simplefilter("error", ConstantRangeWarning)
        with pytest.raises(ConstantRangeWarning):
            PassManager([warns]).run(small_graph())


def test_results_chain_and_modified_is_any_pass_modified():
    gm = small_graph()
    assert PassManager([untouched, untouched]).run(gm) == PassResult(gm, False)
    assert PassManager([untouched, touched, untouched]).run(gm) == PassResult(gm, True)
    other = small_graph()
    assert PassManager([lambda g: PassResult(other, False), untouched]).run(gm).graph is other


def test_pass_names():
    def scale(gm, factor, *, bias=0.0):
        return PassResult(gm, factor != 1.0 or bias != 0.0)

    p = named("scale_twice", scale, 2.0, bias=1.0)
    assert p.__name__ == "scale_twice" and pass_name(p) == "scale_twice"
    assert p(small_graph()).modified
    assert pass_name(functools.partial(scale, factor=1.0)) == "scale"
    assert pass_name(untouched) == "untouched"

    class Fold:
        def __call__(self, gm):
            return PassResult(gm, False)

    assert pass_name(Fold()) == "Fold"


def test_input_errors_turn_a_value_error_into_a_pass_input_error():
    def bad_model(gm):
        for node in gm.graph.nodes:
            if node.name == "neg":
                raise ValueError("value 'neg' is defined twice")
        return PassResult(gm, False)

    with pytest.raises(PassInputError) as info:
        PassManager([bad_model], input_errors=True).run(small_graph())
    err = info.value
    assert isinstance(err, ValueError) and isinstance(err, PassError)
    assert str(err) == "[bad_model] at node 'neg': value 'neg' is defined twice"
    assert isinstance(err.__cause__, ValueError)
    with pytest.raises(PassError) as plain:  # by default a ValueError is a pass's bug
        PassManager([bad_model]).run(small_graph())
    assert not isinstance(plain.value, ValueError)
    assert str(plain.value) == "[bad_model] at node 'neg': ValueError: value 'neg' is defined twice"
    with pytest.raises(PassError) as other:  # other errors stay bugs
        PassManager([lookup_by_op], input_errors=True).run(small_graph())
    assert not isinstance(other.value, ValueError)
