"""Activation checkpointing kept through the rewrite: ``outline_checkpoints`` moves each
region a checkpointed call traced (``node.meta["custom"][REGION_KEY]``, written by
``ampgraph/capture/checkpoints.py``) into a graph of its own, called through
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.

It runs last, after the casts are inserted and the ops routed to the runtime, so a region
is recomputed in backward as it ran in forward: the same precisions, the same casts and
runtime ops. A routed op keeps its node's mark; a cast the passes inserted belongs to a
region when every user of it does; a getitem of a tuple made outside stays outside (the
region takes the tensor, not the tuple). Parameters and every other value
made outside are the region graph's inputs (its get_attr nodes stay in the parent graph:
whoever swaps a module's parameters, such as FSDP2, is seen by both).

A region that cannot be outlined (a value made outside it from its own outputs feeds it
again) stays inline: a :class:`CheckpointWarning`, and an entry in
``gm.meta[UNHONOURED_KEY]`` that ``ampgraph.explain`` prints as a row.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any

import torch
from torch import fx
from torch.utils.checkpoint import checkpoint

from passes._infra import PassResult, visiting
from passes.fx.dtypes import is_amp_cast
from passes.fx.nodes import module_info

# node.meta["custom"][REGION_KEY] = (region id, checkpoint options) on every node traced
# inside a checkpointed call (torch.fx.traceback.annotate)
REGION_KEY = "ampgraph_checkpoint"
# gm.meta[UNHONOURED_KEY]: one dict per region left inline (region, module, nodes, reason)
UNHONOURED_KEY = "amp_unhonoured_checkpoints"


class CheckpointWarning(UserWarning):
    """A checkpointed region of the model is not recomputed in backward: its activations
    are kept, as without checkpointing."""


class CheckpointedRegion:
    """What an outlined region's call node calls: ``checkpoint(forward, *inputs,
    use_reentrant=False, **options)`` with gradients on, the region's graph itself without
    (inference keeps nothing for backward anyway). ``forward`` is ``gm.forward`` until the
    caller sets a faster one (``ampgraph/capture/codegen.py``'s ``direct_runner``).

    Example:
        >>> CheckpointedRegion(sub, {"preserve_rng_state": True}, 0)(x)  # doctest: +SKIP
    """

    def __init__(self, gm: fx.GraphModule, options: dict[str, Any], region: int):
        self.gm = gm
        self.forward = gm.forward
        self.options = options
        self.region = region
        # FX writes a call_function's target into code by its name
        self.__name__ = self.__qualname__ = f"checkpoint_region_{region}"
        self.__module__ = __name__

    def __call__(self, *inputs: Any) -> tuple:
        if not torch.is_grad_enabled():
            return self.forward(*inputs)
        return checkpoint(self.forward, *inputs, use_reentrant=False, **self.options)

    def __repr__(self) -> str:
        return f"CheckpointedRegion({self.region}, {len(self.gm.graph.nodes)} nodes)"


def region_of(node: fx.Node) -> tuple[int, dict[str, Any]] | None:
    """``(region id, checkpoint options)`` of a node traced inside a checkpointed call.

    Example:
        >>> region_of(node)  # doctest: +SKIP
        (0, {'preserve_rng_state': True})
    """
    custom = node.meta.get("custom")
    if not isinstance(custom, dict):
        return None
    return custom.get(REGION_KEY)


def outline_checkpoints(gm: fx.GraphModule) -> PassResult:
    """Outline every checkpointed region of ``gm`` into a :class:`CheckpointedRegion` call
    (see the module docstring); regions that cannot be are reported, never dropped
    silently.

    Example:
        >>> outline_checkpoints(gm).modified  # doctest: +SKIP
        True
    """
    graph = gm.graph
    regions = _regions(graph)
    if not regions:
        return PassResult(gm, False)
    unhonoured = gm.meta.setdefault(UNHONOURED_KEY, [])
    outlined = 0
    for rid, (members, options) in sorted(regions.items()):
        problem = _convexity_problem(graph, members)
        if problem is None:
            _outline(gm, members, options, rid)
            outlined += 1
            continue
        first = min(members, key=_position(graph))
        path, _ = module_info(first)
        unhonoured.append({"region": rid, "module": path, "nodes": len(members),
                           "reason": problem})
        warnings.warn(f"ampgraph: the checkpointed region {rid} at {path or 'the model'} "
                      f"({len(members)} nodes) is not recomputed in backward: {problem}; its "
                      "activations are kept as without checkpointing", CheckpointWarning,
                      stacklevel=2)
    if outlined:
        graph.lint()
    return PassResult(gm, outlined > 0)


def _regions(graph: fx.Graph) -> dict[int, tuple[set[fx.Node], dict[str, Any]]]:
    """Each region's nodes: the annotated ones, then (to a fixed point) the unmarked nodes
    that may join one (:func:`_joins`) and whose users all belong to it. Nothing is added
    for reading a region's values: the ops after the last checkpointed
    block (a final norm, a language model's head) read only its output and parameters, and
    are not to be recomputed."""
    owner: dict[fx.Node, int] = {}
    options: dict[int, dict[str, Any]] = {}
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    for node in visiting(nodes):
        mark = region_of(node)
        if mark is not None:
            owner[node] = mark[0]
            options.setdefault(mark[0], dict(mark[1]))
    if not owner:
        return {}
    changed = True
    while changed:
        changed = False
        for node in reversed(nodes):  # users first: a chain of casts joins in one sweep
            if node in owner or not _joins(node, owner):
                continue
            rid = _common(owner, node.users)
            if rid is not None:
                owner[node] = rid
                changed = True
    regions: dict[int, tuple[set[fx.Node], dict[str, Any]]] = {}
    for node, rid in owner.items():
        regions.setdefault(rid, (set(), options[rid]))[0].add(node)
    return regions


def _common(owner: dict[fx.Node, int], nodes: Any) -> int | None:
    """The region every node of ``nodes`` belongs to, if they all belong to one."""
    found = None
    for node in nodes:
        rid = owner.get(node)
        if rid is None or (found is not None and rid != found):
            return None
        found = rid
    return found


def _joins(node: fx.Node, owner: dict[fx.Node, int]) -> bool:
    """Whether an unmarked node may join the region of its users: a cast the passes
    inserted (``meta["amp_cast"]``: a parameter's, hoisted, or an input's), a getitem of a
    region's tuple, or an op that reads only the graph's inputs and parameters (the
    embedding lookup before the first checkpointed layer: recomputing it costs one
    gather, keeping it its rows, in fp32 at O2 where eager bf16 keeps bf16 ones). Other
    traced ops outside every region stay there, even when one region alone reads them,
    and so does a getitem of a tuple made outside (the CUDA runtime's weight groups: the
    region takes the tensor)."""
    if node.target is operator.getitem:
        return node.args[0] in owner
    return is_amp_cast(node) or all(a.op in ("placeholder", "get_attr")
                                    for a in node.all_input_nodes)


def _position(graph: fx.Graph) -> Any:
    index = {n: i for i, n in enumerate(graph.nodes)}
    return index.__getitem__


def _convexity_problem(graph: fx.Graph, members: set[fx.Node]) -> str | None:
    """Why ``members`` cannot become one call: a node outside them that reads one of them
    and feeds one of them again (directly or not); None if none does."""
    reached: set[fx.Node] = set()  # outside nodes downstream of the region
    for node in graph.nodes:
        inputs = node.all_input_nodes
        if node in members:
            back = next((a for a in inputs if a in reached), None)
            if back is not None:
                return (f"{back.name}, computed outside the region from its values, feeds "
                        f"its node {node.name}")
        elif any(a in members or a in reached for a in inputs):
            reached.add(node)
    for node in members:
        if node.op != "call_function":
            return f"{node.name} is a {node.op} node"
    return None


def _outline(gm: fx.GraphModule, members: set[fx.Node], options: dict[str, Any],
             rid: int) -> None:
    graph = gm.graph
    order = [n for n in graph.nodes if n in members]
    inputs: list[fx.Node] = []
    for node in order:
        for a in node.all_input_nodes:
            if a not in members and a not in inputs:
                inputs.append(a)
    outputs = [n for n in order if any(u not in members for u in n.users)]
    sub = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for a in inputs:
        env[a] = sub.placeholder(a.name)
        env[a].meta = dict(a.meta)
    for node in order:
        env[node] = sub.node_copy(node, env.__getitem__)
    sub.output(tuple(env[n] for n in outputs))
    region = CheckpointedRegion(fx.GraphModule(gm, sub, class_name=f"CheckpointRegion{rid}"),
                                options, rid)
    _sink_region(graph, members, order[-1])
    with graph.inserting_after(order[-1]):
        call = graph.call_function(region, tuple(inputs))
    call.meta["val"] = tuple(n.meta.get("val") for n in outputs)
    call.meta["nn_module_stack"] = order[0].meta.get("nn_module_stack", {})
    call.meta["amp_orig_op"] = "checkpoint"
    call.meta["amp_reason"] = (f"activation checkpoint: {len(order)} nodes recomputed in "
                               "backward in their forward precisions")
    call.meta["amp_absorbed"] = [env[n] for n in order]  # explain's rows for them
    cursor = call
    for k, node in enumerate(outputs):
        with graph.inserting_after(cursor):
            item = graph.call_function(operator.getitem, (call, k))
        item.meta.update({key: node.meta[key] for key in ("val", "tensor_meta")
                          if key in node.meta})
        item.meta["amp_region_output"] = True  # its node's row is the region's
        node.replace_all_uses_with(item, delete_user_cb=lambda u: u not in members)
        cursor = item
    for node in reversed(order):
        graph.erase_node(node)


def _sink_region(graph: fx.Graph, members: set[fx.Node], last: fx.Node) -> None:
    """Move the nodes outside the region that read its values, directly or not, and sit
    before its last node, to just after it (in their order): the call that replaces the
    region goes there. The region being convex, none of them feeds it."""
    downstream: set[fx.Node] = set()
    moved = []
    for node in graph.nodes:
        if node is last:
            break
        if node not in members and any(a in members or a in downstream
                                       for a in node.all_input_nodes):
            downstream.add(node)
            moved.append(node)
    cursor = last
    for node in moved:
        cursor.append(node)
        cursor = node

