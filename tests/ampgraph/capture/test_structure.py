"""ampgraph/capture/structure.py: outputs of any structure are flattened and rebuilt."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn
from torch.utils import _pytree as pytree

import ampgraph
from ampgraph.capture.structure import (
    Baked,
    assign_contents,
    contents_changed,
    custom_objects,
    exportable_inputs,
    flatten_output,
    restored_inputs,
    spec_uses_inputs,
    strip_tensors,
    unflatten_output,
)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    ids: torch.Tensor
    double: torch.Tensor
    name: str


class Mixed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, ids, d):
        y = self.fc(x)
        return {"out": Out(y, ids + 1, d * 2, "tag"), "pair": (y.argmax(-1), y.sum())}


def test_dict_and_dataclass_outputs_int_and_fp64_untouched():
    model = Mixed()
    net = ampgraph.compile(model, "O3", "bf16")
    x, ids, d = torch.randn(2, 4), torch.arange(2), torch.randn(2, dtype=torch.float64)
    out = net(x, ids, d)
    assert isinstance(out["out"], Out) and out["out"].name == "tag"
    assert out["out"].logits.dtype == torch.float32
    assert out["out"].ids.dtype == torch.int64 and torch.equal(out["out"].ids, ids + 1)
    assert out["out"].double.dtype == torch.float64 and torch.equal(out["out"].double, d * 2)
    assert out["pair"][0].dtype == torch.int64


class OddOutputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return {"y": y, "batch": x.shape[0], "opaque": object() if x.dim() > 5 else None}


def test_symbolic_sizes_in_outputs_follow_the_input():
    net = ampgraph.compile(OddOutputs(), "O2", "bf16")
    assert net(torch.randn(3, 4))["batch"] == 3
    assert net(torch.randn(6, 4))["batch"] == 6


class Unrebuildable(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        class Box:  # not a tensor, constant or pytree node
            pass

        box = Box()
        box.value = self.fc(x)
        return box


def test_unrebuildable_outputs_run_eagerly_instead_of_returning_stale_objects():
    model = Unrebuildable()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(2, 4)
    with pytest.warns(UserWarning, match="cannot rebuild"):
        out = net(x)
    assert type(out).__name__ == "Box" and out.value.dtype == torch.float32
    torch.testing.assert_close(out.value, model.fc(x), rtol=2e-2, atol=2e-2)


# -- flatten_output / unflatten_output and the spec helpers, directly ------------------------


Pair = collections.namedtuple("Pair", "a b")


@dataclasses.dataclass
class Frozen:
    x: torch.Tensor
    note: str = "n"


def test_flatten_and_unflatten_round_trip_every_container():
    t1, t2, t3 = torch.ones(1), torch.zeros(2), torch.arange(3)
    out = {"pair": Pair(t1, [t2, (t3, None)]), "cfg": Frozen(t1), "k": torch.float16, "n": 3}
    leaves, spec = flatten_output(out)
    assert [id(t) for t in leaves] == [id(t1), id(t2), id(t3), id(t1)]
    fresh = [torch.full_like(t, 7) for t in leaves]
    back = unflatten_output(spec, fresh)
    assert type(back["pair"]) is Pair and type(back["pair"].b) is list
    assert type(back["pair"].b[1]) is tuple and back["pair"].b[1][1] is None
    assert back["pair"].a is fresh[0] and back["pair"].b[1][0] is fresh[2]
    assert isinstance(back["cfg"], Frozen) and back["cfg"].x is fresh[3]
    assert back["cfg"].note == "n" and back["k"] is torch.float16 and back["n"] == 3
    assert out["cfg"].x is t1  # the template object was copied, not written


def test_an_input_object_returned_as_it_is_stays_the_callers():
    box = {"cache": torch.ones(1)}
    leaves, spec = flatten_output((box, torch.zeros(1)), inputs=[box])
    assert spec_uses_inputs(spec) and len(leaves) == 1
    other = {"cache": None}
    assert unflatten_output(spec, [torch.ones(1)], [other])[0] is other
    assert not spec_uses_inputs(flatten_output((torch.zeros(1), {"a": 1}))[1])


def test_an_object_nothing_can_rebuild_raises_type_error():
    class Opaque:
        pass

    with pytest.raises(TypeError, match="returns a Opaque, which ampgraph cannot rebuild"):
        flatten_output([torch.ones(1), Opaque()])


def test_registered_pytree_nodes_are_flattened_by_pytree():
    class Node:
        def __init__(self, a, b):
            self.a, self.b = a, b

    pytree.register_pytree_node(Node, lambda n: ([n.a, n.b], None),
                                lambda children, _: Node(*children))
    try:
        leaves, spec = flatten_output(Node(torch.ones(1), torch.zeros(1)))
        back = unflatten_output(spec, [torch.full((1,), 5.0), torch.full((1,), 6.0)])
        assert len(leaves) == 2 and isinstance(back, Node) and back.b.item() == 6.0
        assert custom_objects(([Node(1, 2)], {"k": Node(3, 4)}))[1].a == 3
        assert custom_objects((torch.ones(1), [1, (2,)], {"a": None})) == []
    finally:
        pytree._deregister_pytree_node(Node)


def test_contents_changed_and_assign_contents():
    t = torch.ones(1)
    obj = {"a": [t]}
    before = pytree.tree_flatten(obj)
    assert not contents_changed(before, obj)
    obj["a"].append(torch.zeros(1))
    assert contents_changed(before, obj)
    same_shape = {"a": [torch.ones(1)]}  # another tensor object in the same place
    assert contents_changed(pytree.tree_flatten({"a": [t]}), same_shape)

    class Cache:
        def __init__(self, keys):
            self.keys = keys

    target, fresh = Cache([1]), Cache([1, 2])
    target.stale = True
    assign_contents(target, fresh)
    assert target.keys == [1, 2] and not hasattr(target, "stale")


def test_strip_tensors_drops_traced_tensors_from_templates():
    spec = flatten_output({"cfg": Frozen(torch.ones(1)), "d": {"x": torch.ones(1)}})[1]
    stripped = strip_tensors(spec)
    template = stripped[2][0][1][1]
    assert isinstance(template, Frozen) and template.x is None  # every field comes from spec
    assert stripped[1] == {} and spec[1]["d"] is not None  # the original spec is untouched
    rebuilt = unflatten_output(stripped, [torch.full((1,), 2.0), torch.full((1,), 3.0)])
    assert rebuilt["cfg"].x.item() == 2.0 and rebuilt["cfg"].note == "n"
    assert rebuilt["d"]["x"].item() == 3.0


def test_exportable_inputs_make_sizes_tuples_and_refused_constants_none_and_back():
    Point = collections.namedtuple("Point", "x y")
    x = torch.ones(2)
    tree = ((x, torch.Size([2, 3]), [torch.float16, 1]),
            {"p": Point(torch.Size([4]), x), "d": torch.device("cpu"), "k": None})
    out, where = exportable_inputs(tree)
    args, kwargs = out
    assert type(args[1]) is tuple and args[1] == (2, 3)
    assert args[2] == [None, 1] and kwargs["d"] is None and kwargs["k"] is None
    assert type(kwargs["p"]) is Point and type(kwargs["p"].x) is tuple
    assert args[0] is x and kwargs["p"].y is x
    assert where[0][2] == [Baked(torch.float16), None]
    back = restored_inputs(out, where)
    assert back == tree
    assert type(back[0][1]) is torch.Size and type(back[1]["p"].x) is torch.Size
    assert type(back[1]["p"]) is Point


def test_exportable_inputs_leave_a_tree_without_sizes_or_refused_constants_as_it_is():
    x = torch.ones(2)
    tree = ((x, (1, 2.0), [None]), {"mode": "a"})
    out, where = exportable_inputs(tree)
    assert out is tree and where is None and restored_inputs(out, where) is tree
    holder = Frozen(torch.Size([2]))
    assert exportable_inputs((holder,)) == ((holder,), None), \
        "objects other than built-in containers are not searched"
