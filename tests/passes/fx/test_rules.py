"""passes/fx/rules.py: what each node needs of its inputs; the fast split agrees with it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import fx

from passes.fx.dtypes import CAST, dtype_of
from passes.fx.rules import KEEP, Rules, input_slots, mutated_slots, required_dtype
from passes.policy import FP32, LOW
from tests.helpers import make
from tests.passes.fx.helpers import check_pass

aten = torch.ops.aten


def graph_of(target, n_inputs=2, **kwargs):
    g = fx.Graph()
    xs = [g.placeholder(f"x{i}") for i in range(n_inputs)]
    for x in xs:
        x.meta["val"] = torch.empty(2)
    node = g.call_function(target, tuple(xs), kwargs)
    node.meta["val"] = torch.empty(2)
    g.output(node)
    return node, xs


def test_mutated_slots_come_from_the_schema():
    assert mutated_slots(graph_of(aten.add_.Tensor)[0]) == (0,)
    assert mutated_slots(graph_of(aten.add.Tensor)[0]) == ()
    assert mutated_slots(graph_of(torch.add)[0]) == (), "not an op overload"


def test_required_dtype_by_precision():
    low = torch.bfloat16
    node, (x, y) = graph_of(aten.mul.Tensor)
    node.meta["amp_precision"] = LOW
    assert required_dtype(node, 0, x, low) == required_dtype(node, 1, y, low) == low
    node.meta["amp_precision"] = FP32
    x.meta["amp_orig_dtype"] = torch.float32
    assert required_dtype(node, 0, x, low) == torch.float32, "fp32: the original dtype"
    ints, _ = graph_of(aten.mul.Tensor)
    ints.meta["amp_precision"] = LOW
    ints.args[0].meta["val"] = torch.empty(2, dtype=torch.int64)
    assert required_dtype(ints, 0, ints.args[0], low) == KEEP, "not a float input"


def test_in_place_ops_follow_the_written_operand_and_casts_keep_their_inputs():
    low = torch.bfloat16
    node, (x, y) = graph_of(aten.add_.Tensor)
    node.meta["amp_precision"] = LOW
    x.meta["amp_dtype"] = torch.float32
    assert required_dtype(node, 0, x, low) == KEEP, "the written operand is kept"
    assert required_dtype(node, 1, y, low) == torch.float32, "the other follows it"
    user_cast, (z,) = graph_of(CAST, 1, dtype=torch.float16)
    user_cast.meta["amp_precision"] = LOW
    assert required_dtype(user_cast, 0, z, low) == KEEP, "a user's explicit cast is kept"
    assert Rules(low).of(user_cast).keep_all


def test_batch_norm_statistics_keep_their_dtype():
    g = fx.Graph()
    args = [g.placeholder(n) for n in ("x", "w", "b", "mean", "var")]
    for a in args:
        a.meta["val"] = torch.empty(4)
    bn = g.call_function(aten._native_batch_norm_legit_no_training.default,
                         (*args, 0.1, 1e-5))
    bn.meta["amp_precision"] = LOW
    wants = [required_dtype(bn, i, a, torch.float16) for i, a in enumerate(args)]
    assert wants[0] == torch.float16
    assert wants[1:] == [torch.float32] * 4, "weights and statistics at fixed slots: fp32"


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["resnet", "bert_encoder"])
def test_every_input_of_a_rewritten_graph_has_its_required_dtype(name, level):
    """The definition (required_dtype, per input) holds after the pipeline, and the split
    the passes use (a shared per-node rule, by_node shortcut) gives the same answers."""
    model, inputs = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm, _ = check_pass(model, inputs, level, torch.bfloat16)
    rules = Rules(torch.bfloat16)
    checked = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.meta.get("amp_cast"):
            continue
        rule = rules.of(node)
        for slot, arg in input_slots(node):
            want = required_dtype(node, slot, arg, torch.bfloat16)
            assert want is KEEP or dtype_of(arg) == want, (node, slot, arg)
            assert rule.want(slot, arg) == want
            if rule.by_node:
                assert rule.want_node(arg) == want
            checked += 1
    assert checked > 20
