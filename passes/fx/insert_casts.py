"""Cast insertion on an FX graph painted by ``passes.paint``.

Each painted node gets ``node.meta["amp_precision"]`` ("low" | "fp32" | "n/a") and
``node.meta["amp_reason"]`` (:func:`annotate`). :func:`insert_casts` then makes every
node's float inputs match its precision (the rule: ``passes.fx.rules``): one cast per
(producer, dtype) shared by all consumers, casts of parameters and inputs hoisted to the
top of the graph (once per forward, tied weights once; ``passes.fx.cast_factory``).

Dtypes are tracked in ``node.meta["amp_dtype"]`` (read it with
:func:`passes.fx.dtypes.dtype_of`; ``meta["val"]`` keeps the captured shapes). A rewired
node's new dtype is learnt by ``passes.fx.propagate``: an op whose float inputs and outputs
all had one dtype in the captured graph follows its first float input; any other op is
re-run on fake tensors, once per signature. ``exact=True`` re-runs every op: slower, used by
tests to check the fast paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import fx

from passes._infra import PassError, PassResult, visiting
from passes.fx._torch_internals import input_nodes, relink, tree_map
from passes.fx.cast_factory import Caster
from passes.fx.dtypes import dtype_of, float_dtypes, orig_dtype
from passes.fx.nodes import FLOATS, is_view
from passes.fx.propagate import UNKNOWN, DtypeTracker, graph_fake_mode
from passes.fx.rules import KEEP, Rules, input_slots, mutated_slots, slot_value
from passes.paint import Decision
from passes.policy import LOW


def annotate(gm: fx.GraphModule, decisions: Mapping[str, Decision]) -> None:
    """Write the painter's decisions into ``node.meta`` (analysis only, no rewrite)."""
    for node in visiting(gm.graph.nodes):
        meta = node.meta
        d = decisions.get(node.name)
        if d is not None:
            meta["amp_precision"] = d.precision
            meta["amp_reason"] = d.reason
        if "val" in meta and "amp_orig_val" not in meta:
            meta["amp_orig_val"] = meta["val"]
            meta["amp_orig_dtype"] = dtype_of(node)


def insert_casts(
    gm: fx.GraphModule, low: torch.dtype, *, keep_io_types: bool = True, exact: bool = False,
    recompile: bool = True,
) -> PassResult:
    """Insert the casts that make every node's inputs match ``node.meta["amp_precision"]``.

    Args:
        gm: a graph annotated by :func:`annotate`.
        low: the low-precision dtype (torch.bfloat16 or torch.float16).
        keep_io_types: cast float outputs back to their original dtype.
        exact: learn every op's output dtype by running it on fake tensors.
        recompile: regenerate ``gm.forward`` (a pipeline recompiles once at its end).

    Example:
        >>> annotate(gm, paint(build_dataflow(gm), policy)); insert_casts(gm, torch.bfloat16)
    """
    graph = gm.graph
    nodes = list(graph.nodes)
    fake_mode = graph_fake_mode(nodes)
    if fake_mode is None:
        raise PassError("insert_casts", None, "nodes carry no fake-tensor metadata; capture "
                        "the model with torch.export first")
    caster = Caster(gm, fake_mode)
    rules = Rules(low)
    tracker = DtypeTracker(fake_mode, exact)
    captured: set[torch.dtype] = set()  # the float dtypes of the captured graph
    for node in visiting(nodes):
        meta = node.meta
        val = meta.get("val")
        if "amp_dtype" not in meta:  # record every node's dtype before any rewrite
            dtype = val.dtype if isinstance(val, torch.Tensor) else dtype_of(node)
            if dtype is not None:
                meta["amp_dtype"] = dtype
        captured |= float_dtypes(meta.get("amp_orig_val", val))
    tracker.one_float = len(captured) <= 1
    for node in visiting(nodes):
        op = node.op
        if op != "call_function":
            if op == "output" and keep_io_types:
                _cast_outputs(node, caster)
            continue
        meta = node.meta
        if meta.get("amp_cast"):
            continue
        rule = rules.of(node)
        changed = False
        first: Any = UNKNOWN  # dtype of the first float input after the rewrite
        swap: dict[fx.Node, fx.Node] | None = None  # by-node rules: input -> its cast
        if rule.by_node:  # the common case: each input once, wherever it is used
            first = None
            swap = {}
            want_node = rule.want_node
            for arg in input_nodes(node):  # all_input_nodes without its copy, same order
                have = arg.meta.get("amp_dtype")
                if have in FLOATS:
                    want = want_node(arg)
                    if want is not KEEP and have != want:
                        swap[arg] = caster.get(arg, want)
                        have = want
                    if first is None:
                        first = have
            if swap:
                _remap(node, swap)
                changed = True
        elif not rule.keep_all:
            first = None
            replace: dict[tuple[Any, fx.Node], fx.Node] | None = None
            want_of = rule.want
            for slot, arg in input_slots(node):
                have = arg.meta.get("amp_dtype")  # dtype_of(arg): every dtype is recorded
                if have in FLOATS:
                    want = want_of(slot, arg)
                    if want is not KEEP and have != want:
                        if replace is None:
                            replace = {}
                        replace[(slot, arg)] = caster.get(arg, want)
                        have = want  # what the cast (or the value it folds to) holds
                    if first is None and have in FLOATS:
                        first = have
            if replace:
                _rewire(node, replace)
                changed = True
        if changed or meta.get("amp_precision") == LOW:
            tracker.propagate(node, first, swap)
    caster.count += _recast_after_writes(graph)
    if recompile:
        gm.recompile()
    gm.meta["amp_casts"] = gm.meta.get("amp_casts", 0) + caster.count
    return PassResult(gm, caster.count > 0)


def _recast_after_writes(graph: fx.Graph) -> int:
    """A cast sits right after its source's producer and reads the value there. A later
    in-place write to the source or to a view of it (``h[:, :].relu_()``, which export
    keeps in place) must reach the readers after it, as in eager: each such reader gets a
    cast of its own, placed just before it. Returns how many were added."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    writes: dict[fx.Node, list[int]] = {}  # base tensor -> positions of writes into it
    for node in visiting(nodes):
        for slot in mutated_slots(node):
            arg = slot_value(node, slot)
            if isinstance(arg, fx.Node):
                writes.setdefault(_base(arg), []).append(position[node])
    added = 0
    for cast in visiting(n for n in nodes if writes and n.meta.get("amp_cast")):
        marks = writes.get(_base(cast.args[0])) if isinstance(cast.args[0], fx.Node) else None
        for user in list(cast.users) if marks else ():
            if any(position[cast] < m < position.get(user, len(nodes)) for m in marks):
                with graph.inserting_before(user):
                    fresh = graph.call_function(cast.target, cast.args, dict(cast.kwargs))
                fresh.meta.update(cast.meta)
                user.replace_input_with(cast, fresh)
                added += 1
    return added


def _base(node: fx.Node) -> fx.Node:
    """The tensor ``node`` is a view of (through chains of views), or ``node`` itself."""
    while is_view(node):
        node = node.args[0]
    return node


def _rewire(node: fx.Node, replace: Mapping) -> None:
    """Swap the inputs named in ``replace`` ((slot, old) -> new) in ``node``.

    Only the part (args or kwargs) that changes is rebuilt. The node's inputs are re-linked
    once by ``passes.fx._torch_internals.relink`` (``Node._update_args_kwargs``), which is
    what assigning ``node.args`` does, less ``Node.__setattr__``'s re-filing of the node in
    the graph's find_nodes table (its op and target do not change;
    ``Node.replace_input_with`` does not re-file either).
    """
    in_args = in_kwargs = False
    for slot, _ in replace:
        if isinstance(slot, str):
            in_kwargs = True
        else:
            in_args = True
    args, kwargs = node.args, node.kwargs
    if in_args:
        args = tuple(
            replace.get((i, a), a) if isinstance(a, fx.Node) else _swap(a, i, replace)
            for i, a in enumerate(args))
    if in_kwargs:
        kwargs = {k: _swap(a, k, replace) for k, a in kwargs.items()}
    relink(node, args, kwargs)


def _remap(node: fx.Node, swap: Mapping[fx.Node, fx.Node]) -> None:
    """Replace every use of each key of ``swap`` in ``node``'s inputs by its value (one
    re-link, as in :func:`_rewire`)."""
    args = fx.node.map_arg(node.args, lambda n: swap.get(n, n))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: swap.get(n, n)) if node.kwargs \
        else node.kwargs
    relink(node, args, kwargs)


def _swap(value: Any, slot: Any, replace: Mapping) -> Any:
    if isinstance(value, fx.Node):
        return replace.get((slot, value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, slot, replace) for v in value)
    return value


def _cast_outputs(node: fx.Node, caster: Caster) -> None:
    def back(v: Any) -> Any:
        if isinstance(v, fx.Node):
            orig, cur = orig_dtype(v), dtype_of(v)
            if orig in FLOATS and cur in FLOATS and orig != cur:
                return caster.get(v, orig)
        return v

    node.args = tree_map(back, node.args)
