"""What each node needs of its float inputs: the rule cast insertion follows and verify checks.

:func:`required_dtype` is the definition; :class:`Rules` splits it into a per-node part
(:class:`Rule`, worked out once per node and shared between equal nodes) and a per-input
part, which is how ``passes.fx.insert_casts`` and ``passes.fx.verify`` both use it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from passes.fx._torch_internals import OpOverload, op_schema
from passes.fx.dtypes import dtype_of
from passes.fx.nodes import FLOATS, explicit_cast_dtype, is_cast_key, op_key, tensors
from passes.fx.policy import fixed_slots
from passes.policy import FP32, LOW

KEEP = "keep"  # an input taken as it is

# OpOverload -> written argument slots (schemas never change; overloads are interned).
_MUTATED: dict[Any, tuple[int | str, ...]] = {}


def mutated_slots(node: fx.Node) -> tuple[int | str, ...]:
    """The argument slots an in-place or ``out=`` op writes (``()`` for any other node),
    as :func:`input_slots` names them: a position, or the name of a keyword-only
    argument (``out`` of ``aten.div.out``, which spectral norm's power iteration calls).

    Example:
        >>> mutated_slots(add_node)  # aten.add_.Tensor
        (0,)
    """
    t = node.target
    if not isinstance(t, OpOverload):
        return ()
    slots = _MUTATED.get(t)
    if slots is None:
        schema = op_schema(t)
        slots = _MUTATED[t] = () if not schema.is_mutable else tuple(
            a.name if a.kwarg_only else i for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    return slots


def slot_value(node: fx.Node, slot: int | str) -> Any:
    """The argument of ``node`` at ``slot`` (a position or a keyword), None if not given.

    Example:
        >>> slot_value(div_out_node, "out")  # doctest: +SKIP
        buf
    """
    if isinstance(slot, str):
        return node.kwargs.get(slot)
    return node.args[slot] if slot < len(node.args) else None


def required_dtype(node: fx.Node, slot: int | str, arg: fx.Node, low: torch.dtype) -> Any:
    """The dtype input ``arg`` (at position/kwarg ``slot``) must have, or KEEP.

    This one function decides for both cast insertion and verification (both go through
    :class:`Rules`, which splits the decision into a per-node and a per-input part).

    Example:
        >>> required_dtype(linear_node, 0, x_node, torch.bfloat16)
        torch.bfloat16
    """
    return Rules(low).of(node).want(slot, arg)


_ORIG = "orig"  # the input's original dtype


class Rule:
    """What one node needs of its float inputs (the node half of :func:`required_dtype`).

    ``keep_all``: every input is taken as it is; ``mutated``: an in-place op's written
    positions (those inputs are kept, the others follow the written operand); otherwise
    inputs at ``fixed`` positions keep their original dtype and the others get ``default``
    (the low dtype, ``_ORIG`` or KEEP).

    Example:
        >>> Rules(torch.bfloat16).of(linear_node).want(0, x_node)
        torch.bfloat16
    """

    __slots__ = ("keep_all", "node", "mutated", "fixed", "default", "io", "by_node")

    def __init__(self, keep_all: bool, node: fx.Node | None = None, mutated: tuple = (),
                 fixed: tuple = (), default: Any = KEEP, io: torch.dtype | None = None):
        self.keep_all = keep_all
        self.node = node
        self.mutated = mutated
        self.fixed = fixed
        self.default = default
        self.io = io  # an fp32 norm fed low precision (passes.fx.fusions): input 0's dtype
        # what an input wants depends on the input alone, not on its position
        self.by_node = not (keep_all or mutated or fixed or io is not None)

    def want_node(self, arg: fx.Node) -> Any:
        """:meth:`want` of a ``by_node`` rule."""
        meta = arg.meta
        orig = meta["amp_orig_dtype"] if "amp_orig_dtype" in meta else dtype_of(arg)
        if orig not in FLOATS:
            return KEEP
        default = self.default
        return orig if default is _ORIG else default

    def want(self, slot: int | str, arg: fx.Node) -> Any:
        meta = arg.meta
        orig = meta["amp_orig_dtype"] if "amp_orig_dtype" in meta else dtype_of(arg)
        if orig not in FLOATS or self.keep_all:
            return KEEP
        mutated = self.mutated
        if mutated:
            if slot in mutated:
                return KEEP
            written = slot_value(self.node, mutated[0])
            return (dtype_of(written) if isinstance(written, fx.Node) else None) or KEEP
        if slot in self.fixed:
            return orig
        if slot == 0 and self.io is not None:
            return self.io
        default = self.default
        return orig if default is _ORIG else default


_KEEP_ALL = Rule(True)


class Rules:
    """Builds the :class:`Rule` of each node, looking up what depends on the op once per
    op (policy key, fixed and written positions) and sharing equal rules.

    Example:
        >>> rules = Rules(torch.bfloat16)
        >>> [rules.of(n).want(slot, a) for slot, a in input_slots(n)]
        [torch.bfloat16, torch.bfloat16]
    """

    def __init__(self, low: torch.dtype):
        self.low = low
        # id(target) -> (target, getitem, a cast op, written positions, fixed positions)
        self._targets: dict[int, tuple] = {}
        self._shared: dict[tuple, Rule] = {}

    def _target(self, node: fx.Node) -> tuple:
        """(target, getitem, a cast op, written positions, fixed positions), stored."""
        target, key = node.target, op_key(node)
        hit = self._targets[id(target)] = (  # by id: some targets hash slowly
            target, key == "getitem", is_cast_key(key), mutated_slots(node), fixed_slots(key))
        return hit

    def of(self, node: fx.Node) -> Rule:
        meta = node.meta
        if meta.get("amp_inserted"):
            return _KEEP_ALL
        target = node.target
        hit = self._targets.get(id(target))
        if hit is None or hit[0] is not target:
            hit = self._target(node)
        _, getitem, cast_op, mutated, fixed = hit
        if getitem or (cast_op and explicit_cast_dtype(node) is not None):
            return _KEEP_ALL
        if mutated:
            return Rule(False, node, mutated)
        precision = meta.get("amp_precision")
        if precision == LOW:
            default: Any = self.low
        elif precision == FP32:
            default = _ORIG
        else:
            # n/a: integer/bool results do not depend on the input's rounding; others see
            # originals.
            out = tensors(meta.get("amp_orig_val", meta.get("val")))
            default = KEEP if out and all(not t.is_floating_point() for t in out) else _ORIG
        io = meta.get("amp_io")
        rule = self._shared.get((fixed, default, io))
        if rule is None:
            rule = self._shared[(fixed, default, io)] = Rule(False, None, (), fixed, default,
                                                             io)
        return rule


def input_slots(node: fx.Node):
    """(slot, node) for every Node input, slots being arg index or kwarg name.

    Example:
        >>> list(input_slots(add_node))  # aten.add.Tensor(x, y, alpha=2)
        [(0, x), (1, y)]
    """
    for i, a in enumerate(node.args):
        if isinstance(a, fx.Node):
            yield i, a
        elif isinstance(a, (list, tuple)):
            for n in _nodes_in(a):
                yield i, n
    for k, a in node.kwargs.items():
        if isinstance(a, fx.Node):
            yield k, a
        elif isinstance(a, (list, tuple)):
            for n in _nodes_in(a):
                yield k, n


def _nodes_in(value: Any) -> list[fx.Node]:
    if isinstance(value, fx.Node):
        return [value]
    if isinstance(value, (list, tuple)):
        return [n for v in value for n in _nodes_in(v)]
    return []


