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


def _empty_like(d: dict) -> dict:
    out = d.copy()
    out.clear()
    return out
