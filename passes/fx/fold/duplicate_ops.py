"""``merge_duplicate_ops``: each pure aten op computed once per distinct arguments."""

from __future__ import annotations

from torch import fx

from passes._infra import PassResult, visiting
from passes.fx._torch_internals import OpOverload, op_schema
from passes.fx.checkpoints import region_of
from passes.fx.dtypes import is_amp_cast
from passes.fx.nodes import is_view


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
      in place (per-layer zero states), and must not find another changed (nor, on a
      second run, the values under the output casts the first inserted);
    - with ``by_module`` (module precision overrides), ops of different modules;
    - ops of different checkpointed regions (``passes/fx/checkpoints.py``), or of one and
      none: a value shared across regions would tie them together, one region's value
      kept alive for the others instead of recomputed.

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
    for node in visiting(ops):
        if node.is_impure() or node in returned:
            continue
        where = (_module_path(node) if by_module else None, _region_id(node))
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


def _region_id(node: fx.Node) -> int | None:
    region = region_of(node)
    return None if region is None else region[0]


def _returned(graph: fx.Graph) -> set[fx.Node]:
    """The nodes whose values the graph returns, and the bases of those that are views or
    casts ampgraph inserted (an output cast of an earlier run: the passes run again on their
    own output change nothing)."""
    out: set[fx.Node] = set()
    todo = [a for a in graph.output_node().all_input_nodes]
    while todo:
        node = todo.pop()
        if node in out:
            continue
        out.add(node)
        if is_view(node) or is_amp_cast(node):
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
