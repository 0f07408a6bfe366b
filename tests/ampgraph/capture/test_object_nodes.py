"""ampgraph/capture/object_nodes.py: objects flattened by their attributes (tensors as
children, the rest as a hashable context) and rebuilt as the same class; what cannot be
rebuilt is refused with the attribute and the reason."""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

from ampgraph.capture.object_nodes import (
    CHILD,
    UnrebuildableObject,
    flatten_object,
    flatten_object_with_keys,
    rebuild_object,
)


class Layer:
    def __init__(self):
        self.keys = torch.randn(2, 3)
        self.states = {0: torch.randn(4), 1: None}
        self.mixed = [torch.ones(1), [], torch.zeros(2)]
        self.flags = {0: True, 1: False}
        self.sizes = [3, 4]
        self.count = 5
        self.dtype = torch.float32
        self.kind = Layer


class Holder:
    """Stands for an object that is not a pytree node."""

    def __init__(self, value):
        self.value = value


def test_round_trip_keeps_class_attributes_and_order():
    layer = Layer()
    children, context = flatten_object(layer)
    assert [name for name, kept in context.fields if kept is CHILD] == ["keys", "states",
                                                                         "mixed"]
    rebuilt = rebuild_object(children, context)
    assert type(rebuilt) is Layer and rebuilt is not layer
    assert list(vars(rebuilt)) == list(vars(layer))
    assert rebuilt.keys is layer.keys and rebuilt.states is layer.states
    assert rebuilt.flags == layer.flags and rebuilt.sizes == [3, 4] and rebuilt.count == 5
    assert rebuilt.dtype is torch.float32 and rebuilt.kind is Layer


def test_kept_containers_are_fresh_per_rebuild_and_the_context_hashes():
    layer = Layer()
    children, context = flatten_object(layer)
    hash(context)
    assert flatten_object(layer)[1] == context  # the same structure, the same context
    first = rebuild_object(children, context)
    first.flags[0] = False  # what a cache's update does to its flags
    first.sizes.append(9)
    second = rebuild_object(children, context)
    assert second.flags == {0: True, 1: False} and second.sizes == [3, 4]


def test_children_flatten_to_tensor_leaves_through_pytree():
    pytree.register_pytree_node(Layer, flatten_object, rebuild_object,
                                flatten_with_keys_fn=flatten_object_with_keys)
    try:
        layer = Layer()
        leaves, spec = pytree.tree_flatten(layer)
        assert [type(x).__name__ for x in leaves] == ["Tensor", "Tensor", "NoneType",
                                                     "Tensor", "Tensor"]
        doubled = pytree.tree_unflatten([None if t is None else t * 2 for t in leaves], spec)
        torch.testing.assert_close(doubled.states[0], layer.states[0] * 2)
        assert doubled.states[1] is None and doubled.mixed[1] == []
        paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(layer)[0]]
        assert paths[0] == ".keys" and paths[1] == ".states[0]"
        # a nested registered object is a child, flattened by its own node
        outer = Holder(layer)
        children, context = flatten_object(outer)
        assert children == [layer] and context.fields == (("value", CHILD),)
    finally:
        pytree._deregister_pytree_node(Layer)


def test_a_change_of_kept_state_changes_the_context():
    layer = Layer()
    before = flatten_object(layer)[1]
    layer.flags[0] = False
    assert flatten_object(layer)[1] != before


class Bound:
    def __init__(self):
        self.keys = torch.zeros(1)
        self.length = self.get_length  # what some models do to a cache they return

    def get_length(self):
        return 0


@pytest.mark.parametrize("make, words", [
    (Bound, ["'length'", "method bound to the object"]),
    (lambda: Holder(Holder(torch.zeros(1))), ["'value'", "Holder holding tensors",
                                              "register Holder"]),
    (lambda: Holder({1, 2}), None),
    (lambda: Holder(torch.Size([2, 3])), None),
])
def test_unrebuildable_attributes_are_refused_with_the_reason(make, words):
    obj = make()
    if words is None:  # keepable: no error
        rebuild_object(*flatten_object(obj))
        return
    with pytest.raises(UnrebuildableObject) as info:
        flatten_object(obj)
    for word in words:
        assert word in str(info.value)


def test_tensors_in_a_set_and_objects_without_dict_are_refused():
    t = torch.zeros(1)
    with pytest.raises(UnrebuildableObject, match="'value'.*tensors in a set"):
        flatten_object(Holder({t}))

    class Slotted:
        __slots__ = ("x",)

    with pytest.raises(UnrebuildableObject, match="Slotted has no __dict__"):
        flatten_object(Slotted())
