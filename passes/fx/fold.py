"""Cast folding after cast insertion, duplicate and dead ops, and the count of the casts a
graph holds."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult
from passes.fx._torch_internals import OpOverload, op_schema
from passes.fx.dtypes import CAST, _widening, dtype_of, is_amp_cast
from passes.fx.graph import is_view


def fold_casts(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Fold cast chains: casts to the producer's own dtype vanish, ``low -> fp32 -> low``
    becomes the original low value. ``fp32 -> low -> fp32`` is kept: it changes values.

    Example:
        >>> fold_casts(gm).modified
        True
    """
    modified = False
    graph = gm.graph
    # the casts, in graph order (cast insertion makes them all aten._to_copy, which the
    # graph's own op index finds): the only nodes either walk below acts on
    casts = [n for n in graph.find_nodes(op="call_function", target=CAST)
             if n.meta.get("amp_cast")]
    kept = []
    for node in casts:
        src = node.args[0]
        target = node.kwargs["dtype"]
        if dtype_of(src) == target:
            node.replace_all_uses_with(src)
            graph.erase_node(node)
            modified = True
        elif is_amp_cast(src) and dtype_of(src.args[0]) == target and _widening(
            target, dtype_of(src)
        ):
            node.replace_all_uses_with(src.args[0])
            graph.erase_node(node)
            modified = True
        else:
            kept.append(node)
    for node in kept:
        if not node.users:
            graph.erase_node(node)
            modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


def drop_dead_ops(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Remove the aten ops nothing uses any more: the model's own casts whose users the
    cast insertion rewired (HF's RMSNorm ``x.to(float32)`` beside a low ``mul`` converted a
    whole activation on every call for nothing), their inputs in turn, and unused
    parameter reads. Ops with side effects or random draws (``Node.is_impure``) and every
    call that is not an aten op stay.

    Example:
        >>> drop_dead_ops(gm).modified
        True
    """
    def keep(node: fx.Node) -> bool:
        if node.op == "get_attr":
            return False
        return (node.op != "call_function" or not isinstance(node.target, OpOverload)
                or node.is_impure())

    modified = gm.graph.eliminate_dead_code(is_impure_node=keep)
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


def skip_whole_slices(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Let the users of a slice of a whole dimension (``x[:, :]``, ``x[..., 0:]``: start 0,
    step 1, no end or export's ``2**63 - 1``) read its input, which it returns unchanged
    (an exported 2-layer HF LLaMA has 12). The slices are dropped later if nothing else
    uses them (:func:`drop_dead_ops`).

    Example:
        >>> skip_whole_slices(gm).modified
        True
    """
    modified = False
    for node in gm.graph.find_nodes(op="call_function", target=_SLICE):
        if node.kwargs:
            continue
        _, _, start, end, step = (*node.args, *_SLICE_DEFAULTS[len(node.args):])
        if start in (0, None) and step == 1 and (end is None or type(end) is int and end >= 2**62):
            node.replace_all_uses_with(node.args[0])
            modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


_SLICE = torch.ops.aten.slice.Tensor
_SLICE_DEFAULTS = (None, 0, None, None, 1)  # self, dim, start, end, step


def merge_duplicate_ops(gm: fx.GraphModule, by_module: bool = False,
                        recompile: bool = True) -> PassResult:
    """Compute each pure aten op once per distinct arguments: later copies use the first.
    An exported HF model repeats its position ranges, masks and rotary views per layer (a
    2-layer LLaMA 11 of its 193 ops, a T5 39 of 359), and the casts inserted later would
    repeat with them. Left as they are:

    - random draws and ops with side effects (``Node.is_impure``);
    - the whole graph if it has an in-place or ``out=`` op (a shared result could be
      written through one of its uses);
    - values the graph returns, or views of them: the caller may write into one output
      in place (per-layer zero states), and must not find another changed;
    - with ``by_module`` (module precision overrides), ops of different modules.

    Arguments compare with their types (``x * 2`` is not ``x * 2.0``; ``-0.0`` is not
    ``0.0``).

    Example:
        >>> merge_duplicate_ops(gm).modified
        True
    """
    graph = gm.graph
    ops = [n for n in graph.nodes if n.op == "call_function" and isinstance(n.target, OpOverload)]
    if any(op_schema(n.target).is_mutable for n in ops):
        return PassResult(gm, False)
    returned = _returned(graph)
    first: dict = {}
    modified = False
    for node in ops:
        if node.is_impure() or node in returned:
            continue
        where = _module_path(node) if by_module else None
        try:
            key = (node.target, _frozen(node.args), _frozen(node.kwargs), where)
            same = first.setdefault(key, node)
        except TypeError:  # an unhashable argument: not merged
            continue
        if same is not node:
            node.replace_all_uses_with(same)
            graph.erase_node(node)
            modified = True
    if modified and recompile:
        gm.recompile()
    return PassResult(gm, modified)


def _returned(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values the graph returns, and the bases of those that are views."""
    out: set[fx.Node] = set()
    todo = [a for a in graph.output_node().all_input_nodes]
    while todo:
        node = todo.pop()
        if node in out:
            continue
        out.add(node)
        if is_view(node):
            todo.extend(node.all_input_nodes)
    return out


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    return next(reversed(stack.values()))[0] if stack else ""


def _frozen(value: object) -> object:
    """``value`` as a hashable key: lists and dicts as tuples, scalars with their types
    (``2 == 2.0 == True`` in Python), floats by their bits; nodes compare by identity."""
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_frozen(v) for v in value))
    if isinstance(value, dict):
        return (dict, tuple((k, _frozen(v)) for k, v in value.items()))
    if type(value) is float:
        return (float, value.hex())
    if type(value) in (int, bool):
        return (type(value), value)
    return value


def count_casts(gm: fx.GraphModule) -> int:
    """The casts the passes inserted in ``gm`` (``meta["amp_cast"]``).

    Example:
        >>> count_casts(gm)
        7
    """
    return sum(1 for n in gm.graph.nodes if n.meta.get("amp_cast"))
