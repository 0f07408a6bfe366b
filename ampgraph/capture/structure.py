"""Output (and input) structure: flatten any output (dicts, dataclasses, HF ``ModelOutput``,
caches) to tensors and a spec, and rebuild the caller's structure from them."""


from __future__ import annotations

import dataclasses
import enum
from typing import Any

import torch
from torch.utils import _pytree as pytree

CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
                  torch.Size, enum.Enum, type(...))
SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def flatten_output(obj: Any, inputs: list[Any] | tuple = ()) -> tuple[list[torch.Tensor], Any]:
    """Split an output into its tensors and a spec that rebuilds it.

    Plain constants are kept in the spec; symbolic sizes are outputs of the graph; types
    registered with torch's pytree (e.g. HuggingFace caches) are flattened by it; an
    object of ``inputs`` (see :func:`custom_objects`) returned as it is stays the caller's
    object (``"I"``). Anything else raises TypeError, so the module runs eagerly instead
    of returning a stale object.
    """
    flattener = Flattener(inputs)
    return flattener.leaves, flattener.walk(obj)


class Flattener:
    def __init__(self, inputs: list[Any] | tuple = ()):
        self.leaves: list[Any] = []
        self.inputs = {id(o): k for k, o in enumerate(inputs)}

    def walk(self, o: Any) -> Any:
        walk = self.walk
        if isinstance(o, (torch.Tensor, *SYMBOLIC)):
            self.leaves.append(o)
            return ("T", len(self.leaves) - 1)
        if id(o) in self.inputs:
            return ("I", self.inputs[id(o)])
        if dataclasses.is_dataclass(o) and not isinstance(o, type):
            if isinstance(o, dict):  # HuggingFace ModelOutput: a dict and a dataclass
                return ("M", type(o), [(k, walk(v)) for k, v in o.items()])
            fields = [(f.name, walk(getattr(o, f.name))) for f in dataclasses.fields(o)]
            return ("D", o, fields)
        if isinstance(o, dict):
            return ("d", o, [(k, walk(v)) for k, v in o.items()])
        if isinstance(o, tuple) and hasattr(o, "_fields"):
            return ("n", type(o), [walk(v) for v in o])
        if isinstance(o, (list, tuple)):
            return ("l", type(o), [walk(v) for v in o])
        if isinstance(o, CONSTANT_TYPES):
            return ("C", o)
        return self.walk_pytree(o)

    def walk_pytree(self, o: Any) -> Any:
        children, treespec = pytree.tree_flatten(o)
        if treespec.is_leaf():
            raise TypeError(
                f"the model returns a {type(o).__name__}, which ampgraph cannot rebuild from a "
                "captured graph; register it with torch.utils._pytree or return tensors"
            )
        return ("P", treespec, [self.walk(c) for c in children])


def unflatten_output(spec: Any, leaves: Any, inputs: list[Any] | tuple = ()) -> Any:
    """Inverse of :func:`flatten_output` (``inputs``: the call's :func:`custom_objects`)."""
    tag = spec[0]
    if tag == "T":
        return leaves[spec[1]]
    if tag == "C":
        return spec[1]
    if tag == "I":
        return inputs[spec[1]]
    if tag == "M":
        return spec[1](**{k: unflatten_output(s, leaves, inputs) for k, s in spec[2]})
    if tag == "D":
        obj = copy_dataclass(spec[1])
        for name, s in spec[2]:
            object.__setattr__(obj, name, unflatten_output(s, leaves, inputs))
        return obj
    if tag == "d":
        out = spec[1].copy()
        for k, s in spec[2]:
            out[k] = unflatten_output(s, leaves, inputs)
        return out
    if tag == "n":
        return spec[1](*(unflatten_output(s, leaves, inputs) for s in spec[2]))
    if tag == "P":
        return pytree.tree_unflatten([unflatten_output(s, leaves, inputs) for s in spec[2]],
                                     spec[1])
    return spec[1](unflatten_output(s, leaves, inputs) for s in spec[2])


def spec_uses_inputs(spec: Any) -> bool:
    tag = spec[0]
    if tag == "I":
        return True
    if tag in ("M", "D", "d"):
        return any(spec_uses_inputs(s) for _, s in spec[2])
    if tag in ("n", "l", "P"):
        return any(spec_uses_inputs(s) for s in spec[2])
    return False


_BUILTIN_CONTAINERS = (tuple, list, dict)
BUILTIN_NODE_TYPES = frozenset(pytree.BUILTIN_TYPES)


def custom_objects(tree: Any) -> list[Any]:
    """The outermost objects of an input pytree that are registered pytree nodes but not
    built-in containers (HuggingFace caches), in flattening order. A model may mutate
    them; the captured graph returns their new contents and :meth:`Captured.rebuild`
    writes them back into the caller's objects."""
    found: list[Any] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor) or pytree.tree_is_leaf(x):
            return
        if not isinstance(x, _BUILTIN_CONTAINERS):
            found.append(x)
            return
        children, _ = pytree.SUPPORTED_NODES[pytree._get_node_type(x)].flatten_fn(x)
        for child in children:
            visit(child)

    visit(tree)
    return found


def contents_changed(before: tuple[list, Any], obj: Any) -> bool:
    leaves, spec = pytree.tree_flatten(obj)
    old_leaves, old_spec = before
    return spec != old_spec or len(leaves) != len(old_leaves) or any(
        a is not b for a, b in zip(leaves, old_leaves))


def assign_contents(target: Any, fresh: Any) -> None:
    """Make the caller's object hold what the graph computed (its attributes replaced)."""
    target.__dict__.clear()
    target.__dict__.update(fresh.__dict__)


def copy_dataclass(obj: Any) -> Any:
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


def strip_tensors(spec: Any) -> Any:
    """Drop references to traced tensors from a spec's template objects."""
    tag = spec[0]
    if tag == "D":
        template = copy_dataclass(spec[1])
        for name, _ in spec[2]:
            object.__setattr__(template, name, None)
        return ("D", template, [(k, strip_tensors(s)) for k, s in spec[2]])
    if tag == "d":
        return ("d", _empty_like(spec[1]), [(k, strip_tensors(s)) for k, s in spec[2]])
    if tag in ("M",):
        return ("M", spec[1], [(k, strip_tensors(s)) for k, s in spec[2]])
    if tag in ("n", "l", "P"):
        return (tag, spec[1], [strip_tensors(s) for s in spec[2]])
    if tag == "W":  # (out spec, [(input index, its spec)])
        return ("W", strip_tensors(spec[1]), [(k, strip_tensors(s)) for k, s in spec[2]])
    return spec


# constants torch.export refuses as inputs (it takes None, bool, int, float, str, enums)
BAKED_CONSTANTS = (torch.dtype, torch.device, torch.memory_format, torch.layout, complex, bytes,
                   type(...))


@dataclasses.dataclass(frozen=True)
class Baked:
    """Where :func:`exportable_inputs` put None in place of a constant: its value."""

    value: Any


def exportable_inputs(tree: Any) -> tuple[Any, Any]:
    """``tree`` as torch.export can take it, and where it was changed (None when nowhere:
    ``tree`` itself comes back). Only built-in containers are searched.

    - A ``torch.Size`` becomes a tuple of its ints: export checks a size's
      ``dynamic_shapes`` against the size rebuilt as a tuple, then flattens the size to a
      list, and no spec passes both. A tuple of the same ints has one spec that does.
    - A constant export refuses as an input (a dtype, a device, a complex number:
      :data:`BAKED_CONSTANTS`) becomes None. Export bakes constants into the graph anyway,
      and ampgraph keys its graphs on their values (``signature``).

    The exported root gives the model its inputs back (:func:`restored_inputs`).

    Example:
        >>> exportable_inputs(((torch.Size([2, 3]), torch.float16), {}))
        ((((2, 3), None), {}), [[True, Baked(value=torch.float16)], None])
    """
    if type(tree) is torch.Size:
        return tuple(tree), True
    if isinstance(tree, BAKED_CONSTANTS):
        return None, Baked(tree)
    if isinstance(tree, dict) and type(tree) in pytree.BUILTIN_TYPES:
        pairs = {k: exportable_inputs(v) for k, v in tree.items()}
        if all(w is None for _, w in pairs.values()):
            return tree, None
        out = tree.copy()
        out.update((k, v) for k, (v, _) in pairs.items())
        return out, {k: w for k, (_, w) in pairs.items()}
    if type(tree) in (tuple, list) or _is_namedtuple(tree):
        items = [exportable_inputs(v) for v in tree]
        if all(w is None for _, w in items):
            return tree, None
        return _same_sequence(tree, [v for v, _ in items]), [w for _, w in items]
    return tree, None


def restored_inputs(tree: Any, where: Any) -> Any:
    """Inverse of :func:`exportable_inputs`: the sizes and constants put back at ``where``.

    Example:
        >>> restored_inputs(((2, 3), None), [True, Baked(torch.float16)])
        (torch.Size([2, 3]), torch.float16)
    """
    if where is None:
        return tree
    if where is True:
        return torch.Size(tree)
    if isinstance(where, Baked):
        return where.value
    if isinstance(where, dict):
        out = tree.copy()
        out.update((k, restored_inputs(tree[k], w)) for k, w in where.items())
        return out
    return _same_sequence(tree, [restored_inputs(v, w) for v, w in zip(tree, where)])


def _is_namedtuple(x: Any) -> bool:
    return isinstance(x, tuple) and hasattr(x, "_fields")


def _same_sequence(like: Any, items: list) -> Any:
    return type(like)(*items) if _is_namedtuple(like) else type(like)(items)


def _empty_like(d: dict) -> dict:
    out = d.copy()
    out.clear()
    return out
