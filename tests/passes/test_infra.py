"""passes/_infra.py: PassManager names the pass and the node of any failure: the node of
the pass's innermost ``visiting`` loop (none outside such a loop)."""

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
    current_node,
    named,
    pass_name,
    visiting,
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
    for node in visiting(gm.graph.nodes):
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


def test_a_helper_s_own_visiting_loop_names_its_node():
    def helper(node_list):
        for node in visiting(node_list):  # innermost: names "relu" though the caller is at "neg"
            raise ValueError(node.name)

    def outer(gm):
        for node in visiting(gm.graph.nodes):
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


def test_a_loop_without_visiting_names_no_node():
    def plain_loop(gm):
        for node in gm.graph.nodes:  # a local called node no longer names anything
            if node.name == "neg":
                raise ValueError(node.name)
        return PassResult(gm, False)

    with pytest.raises(PassError) as info:
        PassManager([plain_loop]).run(small_graph())
    assert (info.value.pass_name, info.value.node) == ("plain_loop", None)
    assert str(info.value) == "[plain_loop]: ValueError: neg"


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


def test_visiting_names_the_node_whatever_the_loop_variable_is_called():
    def lookup(gm):
        table = {"x": 0}
        for n in visiting(gm.graph.nodes):  # not called node
            check(table, n.name)
        return PassResult(gm, False)

    def check(table, key):  # a helper without any node of its own
        table[key]

    with pytest.raises(PassError) as info:
        PassManager([lookup]).run(small_graph())
    assert (info.value.pass_name, info.value.node) == ("lookup", "relu")
    assert str(info.value) == "[lookup] at node 'relu': KeyError: 'relu'"


def test_visiting_beats_a_node_local_of_another_frame():
    def helper(gm):
        node = gm.graph.output_node()  # a local called node, naming another node
        raise ValueError(node.name)

    def outer(gm):
        for current in visiting(gm.graph.nodes):
            if current.name == "neg":
                helper(gm)
        return PassResult(gm, False)

    with pytest.raises(PassError) as info:
        PassManager([named("outer", outer)]).run(small_graph())
    assert info.value.node == "neg"


def test_nested_visiting_loops_name_the_innermost_and_forget_finished_ones():
    def nested(gm, fail_inside):
        nodes = list(gm.graph.nodes)
        for outer in visiting(nodes):
            for inner in visiting(nodes[:1]):  # finishes: the outer node is current again
                assert current_node() is inner
            assert current_node() is outer
            if outer.name == "neg":
                if fail_inside:
                    for inner in visiting([outer.prev]):
                        raise ValueError(inner.name)
                raise ValueError(outer.name)
        return PassResult(gm, False)

    for fail_inside, where in [(False, "neg"), (True, "relu")]:
        with pytest.raises(PassError) as info:
            PassManager([named("nested", nested, fail_inside)]).run(small_graph())
        assert info.value.node == where


def test_a_loop_left_early_names_where_it_stopped_until_the_pass_ends():
    def breaks(gm):
        for node in visiting(gm.graph.nodes):
            if node.name == "relu":
                break
        raise RuntimeError("after the loop")

    def plain(gm):
        raise RuntimeError("no loop")

    with pytest.raises(PassError) as info:
        PassManager([breaks]).run(small_graph())
    assert info.value.node == "relu"

    def stops(gm):
        for node in visiting(gm.graph.nodes):
            if node.name == "relu":
                break
        return PassResult(gm, False)

    with pytest.raises(PassError) as info:  # the next pass starts with nothing recorded
        PassManager([stops, plain]).run(small_graph())
    assert (info.value.pass_name, info.value.node) == ("plain", None)


def test_visiting_outside_a_pass_manager_is_plain_iteration():
    gm = small_graph()
    assert list(visiting(gm.graph.nodes)) == list(gm.graph.nodes)
    for node in visiting(gm.graph.nodes):
        assert current_node() is None and node is not None
    assert current_node() is None


def test_visiting_inside_enumerate_names_the_node_and_tuples_name_none():
    def pairs(gm, inside):
        items = enumerate(visiting(gm.graph.nodes)) if inside else visiting(
            enumerate(gm.graph.nodes))  # tuples: no name
        for i, node in items:
            if node.name == "neg":
                raise ValueError(i)
        return PassResult(gm, False)

    for inside, where in [(True, "neg"), (False, None)]:
        with pytest.raises(PassError) as info:
            PassManager([named("pairs", pairs, inside)]).run(small_graph())
        assert info.value.node == where


def test_input_errors_turn_a_value_error_into_a_pass_input_error():
    def bad_model(gm):
        for node in visiting(gm.graph.nodes):
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
