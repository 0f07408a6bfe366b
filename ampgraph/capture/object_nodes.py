"""Plain Python objects as pytree nodes by their attributes: the attributes that hold
tensors (or symbolic sizes, or other pytree nodes) are the node's children, every other
attribute is kept in the context, and an object is rebuilt as an instance of the same class
with the same attributes. What HuggingFace caches and their layers need (``hf_caches``)."""


from __future__ import annotations

import collections
import enum
import types
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
_PLAIN_CONTAINERS = (list, tuple, dict, set, frozenset)
# the containers torch's pytree flattens (a namedtuple too): their tensors are leaves
_SEQUENCES = (list, tuple, collections.deque)
_MAPPINGS = (dict, collections.OrderedDict, collections.defaultdict)
_VALUE_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                torch.Size, torch.layout, enum.Enum, type, type(...))


class UnrebuildableObject(TypeError):
    """An object ampgraph cannot flatten into tensors and rebuild from them; the message
    says which attribute and why."""


class Child:
    """Stands in a context for an attribute that is one of the node's children."""

    def __repr__(self) -> str:
        return "<child>"


CHILD = Child()


class Frozen(NamedTuple):
    """A list, tuple, dict or set attribute without tensors, kept as a hashable value and
    made again (a fresh container) for every rebuilt object."""

    kind: type
    items: tuple


class Ref:
    """Any other attribute (a config, a stream), kept by reference: equal only to itself."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Ref) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"Ref({type(self.obj).__name__})"


class ObjectContext(NamedTuple):
    """A node's context: its class and, in attribute order, each attribute's name with
    :data:`CHILD` or its kept value. Hashable, compared by value."""

    cls: type
    fields: tuple[tuple[str, Any], ...]


def holds_leaves(value: Any) -> bool:
    """Whether ``value`` is, or contains in plain lists, tuples and dicts, a tensor, a
    symbolic size or an object of a registered pytree node type (a cache layer)."""
    if isinstance(value, (torch.Tensor, *SYMBOLIC)):
        return True
    kind = type(value)
    if kind in _SEQUENCES or (isinstance(value, tuple) and hasattr(kind, "_fields")):
        return any(holds_leaves(v) for v in value)
    if kind in _MAPPINGS:
        return any(holds_leaves(v) for v in value.values())
    return kind in pytree.SUPPORTED_NODES  # a cache layer, a ModelOutput


def flatten_object(obj: Any) -> tuple[list[Any], ObjectContext]:
    """``obj``'s attributes that hold tensors (children) and the context rebuilding it.

    Raises:
        UnrebuildableObject: ``obj`` has no ``__dict__``, or an attribute that cannot be
            kept in a context: a method bound to ``obj`` itself (a rebuilt object would call
            it on the old one), tensors inside an object that is not a pytree node, or
            tensors inside a set.

    Example:
        >>> children, context = flatten_object(layer)  # doctest: +SKIP
        >>> rebuild_object(children, context)  # a new layer of the same class
    """
    state = getattr(obj, "__dict__", None)
    if state is None:
        raise UnrebuildableObject(
            f"a {type(obj).__qualname__} has no __dict__ (slots): ampgraph rebuilds objects "
            "from their attributes; register the class with torch.utils._pytree")
    children: list[Any] = []
    fields = []
    for name, value in state.items():
        if holds_leaves(value):
            children.append(value)
            fields.append((name, CHILD))
        else:
            fields.append((name, freeze(value, obj, name)))
    return children, ObjectContext(type(obj), tuple(fields))


def flatten_object_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], ObjectContext]:
    """:func:`flatten_object` with each child keyed by its attribute name."""
    children, context = flatten_object(obj)
    names = [name for name, kept in context.fields if kept is CHILD]
    return [(pytree.GetAttrKey(n), c) for n, c in zip(names, children)], context


def rebuild_object(children: Any, context: ObjectContext) -> Any:
    """A new instance of ``context.cls`` (``__init__`` is not called) with the attributes
    :func:`flatten_object` saw, the children put back in their places."""
    obj = context.cls.__new__(context.cls)
    given = iter(children)
    obj.__dict__.update(
        (name, next(given) if kept is CHILD else thaw(kept)) for name, kept in context.fields)
    return obj


def freeze(value: Any, owner: Any = None, name: str = "") -> Any:
    """A hashable stand-in for an attribute value without tensors (see :func:`thaw`)."""
    if isinstance(value, _VALUE_TYPES):
        if isinstance(value, torch.Size) and any(isinstance(v, SYMBOLIC) for v in value):
            raise UnrebuildableObject(_where(owner, name) + "is a torch.Size with symbolic "
                                      "sizes; keep sizes as ints or tensors")
        return value
    kind = type(value)
    if kind in _PLAIN_CONTAINERS:
        if kind is dict:
            return Frozen(dict, tuple((k, freeze(v, owner, name)) for k, v in value.items()))
        if any(isinstance(v, (torch.Tensor, *SYMBOLIC)) for v in value):
            raise UnrebuildableObject(_where(owner, name) + f"holds tensors in a {kind.__name__}, "
                                      "which is not a pytree container")
        return Frozen(kind, tuple(freeze(v, owner, name) for v in value))
    if isinstance(value, types.MethodType) and value.__self__ is owner:
        raise UnrebuildableObject(
            _where(owner, name) + "is a method bound to the object itself: a rebuilt object "
            "would still call it on the old one (set it on the class instead)")
    inner = getattr(value, "__dict__", None)
    if inner and any(holds_leaves(v) for v in inner.values()):
        raise UnrebuildableObject(
            _where(owner, name) + f"is a {kind.__qualname__} holding tensors, which is not a "
            f"pytree node: register {kind.__qualname__} with torch.utils._pytree")
    return Ref(value)


def thaw(kept: Any) -> Any:
    """The attribute value :func:`freeze` stood for; containers are made anew."""
    if isinstance(kept, Ref):
        return kept.obj
    if isinstance(kept, Frozen):
        if kept.kind is dict:
            return {k: thaw(v) for k, v in kept.items}
        return kept.kind(thaw(v) for v in kept.items)
    return kept


def _where(owner: Any, name: str) -> str:
    return f"cannot rebuild a {type(owner).__qualname__}: its attribute {name!r} "
