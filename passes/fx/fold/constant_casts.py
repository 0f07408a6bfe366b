"""``fold_constant_casts``: a cast of a constant the graph owns is made once, at rewrite time.

``torch.tensor(...)`` inside a traced model becomes a constant of the graph module (a plain
attribute, neither parameter nor buffer: nothing outside the graph can reach or change
it) read through ``lift_fresh_copy``, which copies it on every call. Where such a constant
meets a low-precision op, cast insertion adds a cast, so each call runs a copy and a cast
of a value that never changes: HF's ``DynamicCache`` starts every layer's keys and values
from ``torch.tensor([])``, two copies and two casts per layer and step (GPT-2: 48 ops a
forward). This pass computes such casts once and reads the result as a new constant of
the graph: same values (the cast is aten's own ``_to_copy``, run on the constant), no op
at run time, and the copy and detach before it are dropped as unused.
"""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import CAST, is_amp_cast
from passes.fx.nodes import fetch_attr

aten = torch.ops.aten

# ops between a constant and its cast that only copy or alias it
PASS_THROUGH = {aten.lift_fresh_copy.default, aten.detach.default, aten.alias.default,
                aten.clone.default}
# gm.meta[FOLDED_KEY]: the constants read through a copy made here (a module's plain
# tensor attribute the model later assigns again cannot be swapped into such a graph)
FOLDED_KEY = "amp_folded_constants"
# a constant up to this size gets a folded copy (the graph's constants are scalars and
# empty tensors; a large one would double its memory for one cast a call)
MAX_NUMEL = 1 << 16


def fold_constant_casts(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Replace each inserted cast whose input is, through copies and detaches, a constant
    of ``gm`` (a ``get_attr`` of a plain tensor attribute, at most :data:`MAX_NUMEL`
    elements) by a ``get_attr`` of that constant cast once.

    Example:
        >>> fold_constant_casts(gm).modified  # GPT-2: each layer's empty cache tensors
        True
    """
    folded: dict[tuple[str, str], fx.Node] = {}  # (constant, cast arguments) -> its get_attr
    modified = False
    casts = [n for n in gm.graph.find_nodes(op="call_function", target=CAST) if is_amp_cast(n)]
    for cast in visiting(casts):
        source = _constant_source(gm, cast.args[0])
        if source is None:
            continue
        key = (source.target, repr(sorted(cast.kwargs.items())))
        read = folded.get(key)
        if read is None:
            value = CAST(fetch_attr(gm, source.target), **cast.kwargs)
            with gm.graph.inserting_before(source):  # a plain attribute, as export's own
                read = gm.graph.create_node("get_attr", _new_attr(gm, source.target, value))
            read.meta.update({k: v for k, v in cast.meta.items() if k != "amp_cast"})
            read.meta["amp_reason"] = f"{source.target} cast once, when the graph was rewritten"
            folded[key] = read
            gm.meta.setdefault(FOLDED_KEY, set()).add(source.target)
        cast.replace_all_uses_with(read)
        gm.graph.erase_node(cast)
        modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


def _constant_source(gm: fx.GraphModule, node: fx.Node) -> fx.Node | None:
    """The ``get_attr`` of a small plain-tensor constant that ``node`` copies, or None."""
    while node.op == "call_function" and node.target in PASS_THROUGH and not node.kwargs \
            and len(node.args) == 1 and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    if node.op != "get_attr":
        return None
    owner_path, _, attr = node.target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    value = owner.__dict__.get(attr)  # parameters and buffers live in their own dicts
    if type(value) is not torch.Tensor or value.requires_grad or value.numel() > MAX_NUMEL:
        return None
    return node


def _new_attr(gm: fx.GraphModule, target: str, value: torch.Tensor) -> str:
    """Store ``value`` as a plain attribute beside ``target``'s; its dotted path."""
    owner_path, _, attr = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    name = f"{attr}_{str(value.dtype).removeprefix('torch.')}"
    stem, i = name, 1
    while hasattr(owner, name):
        name, i = f"{stem}_{i}", i + 1
    object.__setattr__(owner, name, value)
    return f"{owner_path}.{name}" if owner_path else name
