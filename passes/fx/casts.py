"""Cast insertion and cast folding on an FX graph painted by ``passes.paint``.

Each painted node gets ``node.meta["amp_precision"]`` ("low" | "fp32" | "n/a") and
``node.meta["amp_reason"]``. ``insert_casts`` then makes every node's float inputs match
its precision: one cast per (producer, dtype) shared by all consumers, casts of
parameters and inputs hoisted to the top of the graph (once per forward, tied weights
once).

Dtypes are tracked in ``node.meta["amp_dtype"]`` (read it with :func:`dtype_of`;
``meta["val"]`` keeps the captured shapes). An op whose float inputs and outputs all had
one dtype in the captured graph follows its first float input; any other op is re-run on
fake tensors to learn its output dtype, once per signature (op, input dtypes/shapes/strides,
other arguments): an op met again with a signature already run, whose value already matches
that run's result, keeps it (see :class:`_DtypeTracker`). ``exact=True`` re-runs every op:
slower, used by tests to check the fast paths.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from passes._infra import ConstantRangeWarning, PassError, PassResult
from passes.fx.graph import FLOATS, _is_cast_key, explicit_cast_dtype, op_key, tensors
from passes.paint import Decision
from passes.policy import FP32, LOW, fixed_slots

CAST = torch.ops.aten._to_copy.default
KEEP = "keep"  # an input taken as it is


def is_amp_cast(node: Any) -> bool:
    return isinstance(node, fx.Node) and bool(node.meta.get("amp_cast"))


def dtype_of(node: Any) -> torch.dtype | None:
    """The dtype a node's (single) tensor output has after the rewrite so far."""
    if not isinstance(node, fx.Node):
        return None
    meta = node.meta
    if "amp_dtype" in meta:
        return meta["amp_dtype"]
    val = meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    ts = tensors(val)
    return ts[0].dtype if len(ts) == 1 else None


def _set_dtype(node: fx.Node, dtype: torch.dtype | None) -> None:
    if dtype is not None:
        node.meta["amp_dtype"] = dtype


def _orig_dtype(node: fx.Node) -> torch.dtype | None:
    meta = node.meta
    return meta["amp_orig_dtype"] if "amp_orig_dtype" in meta else dtype_of(node)


# OpOverload -> written argument positions (schemas never change; overloads are interned).
_MUTATED: dict[Any, tuple[int, ...]] = {}


def mutated_slots(node: fx.Node) -> tuple[int, ...]:
    t = node.target
    if not isinstance(t, torch._ops.OpOverload):
        return ()
    slots = _MUTATED.get(t)
    if slots is None:
        slots = _MUTATED[t] = () if not t._schema.is_mutable else tuple(
            i for i, a in enumerate(t._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write)
    return slots


def required_dtype(node: fx.Node, slot: int | str, arg: fx.Node, low: torch.dtype) -> Any:
    """The dtype input ``arg`` (at position/kwarg ``slot``) must have, or KEEP.

    This one function decides for both cast insertion and verification (both go through
    :class:`_Rules`, which splits the decision into a per-node and a per-input part).
    """
    return _Rules(low).of(node).want(slot, arg)


_ORIG = "orig"  # the input's original dtype


class _Rule:
    """What one node needs of its float inputs (the node half of :func:`required_dtype`).

    ``keep_all``: every input is taken as it is; ``mutated``: an in-place op's written
    positions (those inputs are kept, the others follow the written operand); otherwise
    inputs at ``fixed`` positions keep their original dtype and the others get ``default``
    (the low dtype, ``_ORIG`` or KEEP).
    """

    __slots__ = ("keep_all", "node", "mutated", "fixed", "default", "io", "by_node")

    def __init__(self, keep_all: bool, node: fx.Node | None = None, mutated: tuple = (),
                 fixed: tuple = (), default: Any = KEEP, io: torch.dtype | None = None):
        self.keep_all = keep_all
        self.node = node
        self.mutated = mutated
        self.fixed = fixed
        self.default = default
        self.io = io  # an fp32 norm fed low precision (passes.fx.fuse): input 0's dtype
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
            return dtype_of(self.node.args[mutated[0]]) or KEEP
        if slot in self.fixed:
            return orig
        if slot == 0 and self.io is not None:
            return self.io
        default = self.default
        return orig if default is _ORIG else default


_KEEP_ALL = _Rule(True)


class _Rules:
    """Builds the :class:`_Rule` of each node, looking up what depends on the op once per
    op (policy key, fixed and written positions) and sharing equal rules."""

    def __init__(self, low: torch.dtype):
        self.low = low
        # id(target) -> (target, getitem, a cast op, written positions, fixed positions)
        self._targets: dict[int, tuple] = {}
        self._shared: dict[tuple, _Rule] = {}

    def _target(self, node: fx.Node) -> tuple:
        """(target, getitem, a cast op, written positions, fixed positions), stored."""
        target, key = node.target, op_key(node)
        hit = self._targets[id(target)] = (  # by id: some targets hash slowly
            target, key == "getitem", _is_cast_key(key), mutated_slots(node), fixed_slots(key))
        return hit

    def of(self, node: fx.Node) -> _Rule:
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
            return _Rule(False, node, mutated)
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
            rule = self._shared[(fixed, default, io)] = _Rule(False, None, (), fixed, default,
                                                              io)
        return rule


def _slots(node: fx.Node):
    """(slot, node) for every Node input, slots being arg index or kwarg name."""
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


class _Caster:
    """Creates and shares cast nodes: one per (producer, dtype)."""

    def __init__(self, gm: fx.GraphModule, fake_mode: Any):
        self.gm = gm
        self.fake_mode = fake_mode
        # dtype -> producer key -> its cast. Nested, not keyed by (producer, dtype) pairs: a
        # pair per cast would be ~6% more objects that outlive the pass on a large graph.
        self.cache: dict[torch.dtype, dict[Any, fx.Node]] = {}
        self._attr_keys: dict[fx.Node, Any] = {}  # get_attr node -> its tensor's id
        self._reasons: dict[tuple[Any, torch.dtype], str] = {}
        self.anchor = _hoist_anchor(gm.graph)
        self.count = 0
        # the name create_node derives from the target, worked out once ("_to_copy_default")
        self.name = _cast_name(gm.graph)
        # nodes may get their args after creation unless a create-node hook wants to see them
        self.fast = hasattr(fx.Node, "_update_args_kwargs") and not getattr(
            gm, "_create_node_hooks", None)

    def _key(self, src: fx.Node) -> Any:
        if src.op == "get_attr":  # tied weights: one cast per tensor, not per name
            key = self._attr_keys.get(src)
            if key is None:
                try:
                    key = id(_fetch_attr(self.gm, src.target))
                except AttributeError:
                    key = src
                self._attr_keys[src] = key
            return key
        return src

    def get(self, src: fx.Node, dtype: torch.dtype) -> fx.Node:
        src_meta = src.meta
        # fold: cast(widen(x), dtype(x)) is x itself (low -> fp32 is exact).
        if src_meta.get("amp_cast") or explicit_cast_dtype(src) is not None:
            inner = src.args[0]
            if (isinstance(inner, fx.Node) and dtype_of(inner) == dtype
                    and _widening(dtype, dtype_of(src))):
                return inner
        key = self._key(src)
        casts = self.cache.get(dtype)
        if casts is None:
            casts = self.cache[dtype] = {}
        cast = casts.get(key)
        if cast is not None:
            return cast
        graph = self.gm.graph
        value = src
        if src_meta.get("amp_saturate") is not None and dtype in (torch.float16, torch.bfloat16):
            hoist = src.op in ("get_attr", "placeholder")
            with graph.inserting_after(self.anchor if hoist else src):
                value = self._saturate(src, dtype)
        with graph.inserting_after(value):
            if self.fast:
                # Args set after creation: create_node's scan of them for raw symbolic
                # values costs more than the rest of the node; ours are a node and a dtype.
                cast = graph.create_node("call_function", CAST, name=self.name)
                cast._update_args_kwargs((value,), {"dtype": dtype})
            else:
                cast = graph.create_node("call_function", CAST, (value,), {"dtype": dtype},
                                         name=self.name)
        src_dtype = dtype_of(src)
        reason = self._reasons.get((src_dtype, dtype))
        if reason is None:
            reason = self._reasons[(src_dtype, dtype)] = f"cast {src_dtype} -> {dtype}"
        meta = cast.meta
        meta["amp_cast"] = True
        meta["amp_precision"] = "n/a"
        meta["amp_reason"] = reason
        if "nn_module_stack" in src_meta:
            meta["nn_module_stack"] = src_meta["nn_module_stack"]
        meta["val"] = src_meta.get("val")  # shapes; the dtype is amp_dtype
        _set_dtype(cast, dtype)
        casts[key] = cast
        self.count += 1
        return cast

    def _saturate(self, src: fx.Node, dtype: torch.dtype) -> fx.Node:
        """Clamp a -inf stand-in (a mask fill beyond ``dtype``'s range) before casting."""
        limit = float(torch.finfo(dtype).max)
        value = self.gm.graph.call_function(torch.ops.aten.clamp.default, (src, -limit, limit))
        value.meta.update(
            val=src.meta.get("val"), amp_dtype=dtype_of(src), amp_precision="n/a",
            amp_inserted=True,
            amp_reason=f"range: clamp a mask fill to +-{limit:g} before the {dtype} cast "
                       "(exact for masking)")
        warnings.warn(
            f"ampgraph: {src.name} holds a mask fill ({src.meta['amp_saturate']:g} or lower) "
            f"beyond {dtype}'s range; it is clamped to -{limit:g} before the cast, which is "
            "exact for masking (exp underflows to 0 either way)",
            ConstantRangeWarning, stacklevel=2)
        return value


def _cast_name(graph: fx.Graph) -> str | None:
    """The name candidate create_node derives for a cast ("_to_copy_default"), or None (let
    it derive it). Worked out once; given sanitised, create_node skips a regex rewrite."""
    try:
        from torch.fx.graph import _illegal_char_regex

        return _illegal_char_regex.sub("_", graph._target_to_str(CAST)) or None
    except (ImportError, AttributeError):
        return None


def _widening(low: torch.dtype, high: torch.dtype | None) -> bool:
    return high == torch.float32 and low in (torch.float16, torch.bfloat16)


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _hoist_anchor(graph: fx.Graph) -> fx.Node:
    anchor = None
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            anchor = node
    if anchor is None:
        raise PassError("insert_casts", None, "graph has no inputs or parameters")
    return anchor


def annotate(gm: fx.GraphModule, decisions: Mapping[str, Decision]) -> None:
    """Write the painter's decisions into ``node.meta`` (analysis only, no rewrite)."""
    for node in gm.graph.nodes:
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
    fake_mode = _detect_fake_mode(nodes)
    if fake_mode is None:
        raise PassError("insert_casts", None, "nodes carry no fake-tensor metadata; capture "
                        "the model with torch.export first")
    caster = _Caster(gm, fake_mode)
    rules = _Rules(low)
    tracker = _DtypeTracker(fake_mode, exact)
    captured: set[torch.dtype] = set()  # the float dtypes of the captured graph
    for node in nodes:
        meta = node.meta
        val = meta.get("val")
        if "amp_dtype" not in meta:  # record every node's dtype before any rewrite
            dtype = val.dtype if isinstance(val, torch.Tensor) else dtype_of(node)
            if dtype is not None:
                meta["amp_dtype"] = dtype
        captured |= _float_dtypes(meta.get("amp_orig_val", val))
    tracker.one_float = len(captured) <= 1
    for node in nodes:
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
        first: Any = _UNKNOWN  # dtype of the first float input after the rewrite
        swap: dict[fx.Node, fx.Node] | None = None  # by-node rules: input -> its cast
        if rule.by_node:  # the common case: each input once, wherever it is used
            first = None
            swap = {}
            want_node = rule.want_node
            for arg in node._input_nodes:  # all_input_nodes without its copy, same order
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
            for slot, arg in _slots(node):
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
    if recompile:
        gm.recompile()
    gm.meta["amp_casts"] = gm.meta.get("amp_casts", 0) + caster.count
    return PassResult(gm, caster.count > 0)


_UNKNOWN = object()
_PLAIN = (int, float, bool, str, torch.SymInt, torch.SymFloat, torch.SymBool)


def _detect_fake_mode(nodes: list[fx.Node]) -> Any:
    """``detect_fake_mode`` over the nodes' values, handed one fake tensor per fake mode.

    Which mode it returns, and whether it finds two, depends only on the order in which
    modes first appear; a graph holds tens of thousands of fake tensors of one mode.
    """
    leaves: list[Any] = []
    modes: set[int] = set()

    def visit(v: Any) -> None:
        if isinstance(v, FakeTensor):
            if id(v.fake_mode) not in modes:
                modes.add(id(v.fake_mode))
                leaves.append(v)
        elif isinstance(v, (list, tuple)):
            for x in v:
                visit(x)
        elif v is not None and not isinstance(v, _PLAIN):
            leaves.append(v)  # anything else (a tensor subclass ...): as it is

    last = None  # the mode of the last fake tensor seen (almost always the only one)
    for n in nodes:
        v = n.meta.get("val")
        if type(v) is FakeTensor and v.fake_mode is last:
            continue
        visit(v)
        if type(v) is FakeTensor:
            last = v.fake_mode
    return detect_fake_mode(leaves)


def _rewire(node: fx.Node, replace: Mapping) -> None:
    """Swap the inputs named in ``replace`` ((slot, old) -> new) in ``node``.

    Only the part (args or kwargs) that changes is rebuilt. The node's inputs are re-linked
    once by ``Node._update_args_kwargs``, which is what assigning ``node.args`` does, less
    ``Node.__setattr__``'s re-filing of the node in the graph's find_nodes table (its op and
    target do not change; ``Node.replace_input_with`` does not re-file either).
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
    _relink(node, args, kwargs)


def _remap(node: fx.Node, swap: Mapping[fx.Node, fx.Node]) -> None:
    """Replace every use of each key of ``swap`` in ``node``'s inputs by its value."""
    args = fx.node.map_arg(node.args, lambda n: swap.get(n, n))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: swap.get(n, n)) if node.kwargs \
        else node.kwargs
    _relink(node, args, kwargs)


def _relink(node: fx.Node, args: tuple, kwargs: dict) -> None:
    """Set ``node``'s inputs with one re-link (see :func:`_rewire`)."""
    if _UPDATE_ARGS:
        node._update_args_kwargs(args, kwargs)
    else:
        node.args, node.kwargs = args, kwargs


_UPDATE_ARGS = hasattr(fx.Node, "_update_args_kwargs")


def _swap(value: Any, slot: Any, replace: Mapping) -> Any:
    if isinstance(value, fx.Node):
        return replace.get((slot, value), value)
    if isinstance(value, (list, tuple)):
        return type(value)(_swap(v, slot, replace) for v in value)
    return value


def _cast_outputs(node: fx.Node, caster: _Caster) -> None:
    def back(v: Any) -> Any:
        if isinstance(v, fx.Node):
            orig, cur = _orig_dtype(v), dtype_of(v)
            if orig in FLOATS and cur in FLOATS and orig != cur:
                return caster.get(v, orig)
        return v

    node.args = tree_map(back, node.args)


_NO_FLOATS: frozenset = frozenset()


_DTYPE_SETS: dict[torch.dtype, frozenset] = {}  # dtype -> {dtype} if floating, else {}


def _float_dtypes(value: Any) -> frozenset:
    """The floating-point dtypes of the tensors in a meta value."""
    if isinstance(value, torch.Tensor):
        dtype = value.dtype
        found = _DTYPE_SETS.get(dtype)
        if found is None:
            found = _DTYPE_SETS[dtype] = (frozenset((dtype,)) if dtype.is_floating_point
                                          else _NO_FLOATS)
        return found
    return frozenset(t.dtype for t in tensors(value) if t.is_floating_point())


def _names_dtype(node: fx.Node) -> bool:
    for v in node.args:
        if isinstance(v, torch.dtype):
            return True
    for v in node.kwargs.values():
        if isinstance(v, torch.dtype):
            return True
    return False


class _Unkeyable(Exception):
    """A value :func:`_sig` cannot describe exactly (the op is then re-run)."""


_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
            torch.memory_format)


def _dims(sizes: Any) -> tuple:
    dims = tuple(sizes)
    for d in dims:
        if type(d) is not int:
            return tuple(_dim(d) for d in dims)
    return dims


def _dim(d: Any) -> Any:
    if type(d) is int:
        return d
    if isinstance(d, torch.SymInt):
        return ("sym", str(d))  # one expression over the graph's shape symbols
    raise _Unkeyable


_STRIDED = torch.strided


def _sig(value: Any) -> Any:
    """Everything of a meta value an op's output dtypes, shapes and strides can depend on."""
    if type(value) is FakeTensor:
        if value.layout is not _STRIDED:
            raise _Unkeyable
        offset = value.storage_offset()
        if not value._has_symbolic_sizes_strides and type(offset) is int:
            return (value.dtype, value.shape, value.stride(), offset, value.fake_device,
                    value.requires_grad)
        return (value.dtype, _dims(value.shape), _dims(value.stride()), _dim(offset),
                value.fake_device, value.requires_grad)
    if isinstance(value, torch.Tensor):
        raise _Unkeyable  # a real tensor or another subclass
    if isinstance(value, (tuple, list)):
        return (type(value), tuple([_sig(v) for v in value]))
    if isinstance(value, _SCALARS):
        return (type(value), value)
    raise _Unkeyable


class _DtypeTracker:
    """Learns the dtype a rewritten node outputs (``meta["amp_dtype"]``, ``meta["val"]``).

    - An op whose float inputs and outputs all had one dtype in the captured graph, with
      one tensor output, follows its first float input (a rule).
    - Any other op is run on fake tensors with its inputs in their new dtypes. The result
      is a function of the op, of its tensor inputs' dtypes, shapes, strides, offsets,
      devices and ``requires_grad``, and of its other arguments, so runs are remembered by
      those: an op met again with the same signature whose ``meta["val"]`` already matches
      the remembered result keeps it (running it would rebuild an identical value; e.g. an
      fp32 layer norm fed its original dtypes again), otherwise it runs. Values that cannot
      be described exactly (real tensors, unhashable arguments) always run, and so does
      operator ``getitem`` (no kernel, it returns the producer's own tensor).

    ``exact=True`` runs every op (the reference the tests compare the rule with).
    """

    def __init__(self, fake_mode: Any, exact: bool):
        self.fake_mode = fake_mode
        self.exact = exact
        self.results: dict[Any, Any] = {}  # run signature -> output signature
        # node -> its captured float dtypes (amp_orig_val never changes in the pass)
        self._orig_floats: dict[fx.Node, frozenset] = {}
        self._shared: dict[frozenset, frozenset] = {}
        self._source_keys: dict[fx.Node, tuple[Any, Any, Any]] = {}  # input -> key
        # the captured graph has at most one float dtype, so every op's float inputs and
        # outputs had it: an op follows its inputs unless it names a dtype
        self.one_float = False

    def propagate(self, node: fx.Node, first: Any = _UNKNOWN,
                  swap: Mapping[fx.Node, fx.Node] | None = None) -> None:
        """Set ``node``'s dtype after its inputs were rewired. ``first``: the dtype of its
        first float input, when the caller knows it (None: it has none). ``swap``: the
        inputs that were replaced, each by the node now in its place (None: unknown)."""
        if not self.exact:
            val = node.meta.get("val")
            single = isinstance(val, torch.Tensor) or len(tensors(val)) == 1
            if single and self._follows_inputs(node):
                if first is _UNKNOWN:
                    first = next((d for _, a in _slots(node) if (d := dtype_of(a)) in FLOATS),
                                 None)
                if first is not None:
                    _set_dtype(node, first)
                    return
            if node.target is not operator.getitem:
                if swap is not None and _sees_captured_inputs(node, swap):
                    node.meta.pop("amp_dtype", None)  # its captured value still holds
                    _set_dtype(node, dtype_of(node))
                    return
                key = self._run_key(node)
                if key is not None:
                    known = self.results.get(key)
                    if known is not None and known == _val_sig(val):
                        node.meta.pop("amp_dtype", None)
                        _set_dtype(node, dtype_of(node))
                        return
                    self._run(node)
                    out = _val_sig(node.meta.get("val"))
                    if out is not None:
                        self.results[key] = out
                    return
        self._run(node)

    def _floats_of(self, a: fx.Node, own: bool) -> frozenset:
        """:func:`_float_dtypes` of a node's captured value (``own``: no ``val`` fallback).

        Cached where it cannot change during the pass: ``amp_orig_val``, and the value of a
        cast (casts are never re-run).
        """
        meta = a.meta
        if own and "amp_orig_val" not in meta:
            return _NO_FLOATS
        hit = self._orig_floats.get(a)
        if hit is not None:
            return hit
        if "amp_orig_val" in meta:
            found = _float_dtypes(meta["amp_orig_val"])
        elif meta.get("amp_cast"):
            found = _float_dtypes(meta.get("val"))
        else:
            return _float_dtypes(meta.get("val"))
        hit = self._orig_floats[a] = self._shared.setdefault(found, found)
        return hit

    def _follows_inputs(self, node: fx.Node) -> bool:
        """In the captured graph, all float inputs and outputs of ``node`` had one dtype,
        and it names no dtype (each node's captured dtypes are looked up once)."""
        if self.one_float:  # (no float at all: the caller finds no first float input)
            return not _names_dtype(node)
        floats_of, cache = self._floats_of, self._orig_floats
        dtypes = cache.get(node)  # only nodes with amp_orig_val or casts are cached
        if dtypes is None or node.meta.get("amp_cast"):
            dtypes = floats_of(node, True)
        for a in node._input_nodes:  # all_input_nodes without its copy: a dict, same order
            more = cache.get(a)
            if more is None:
                more = floats_of(a, False)
            if more is not dtypes:
                dtypes = dtypes | more
                if len(dtypes) > 1:
                    return False  # the union only grows
        return len(dtypes) == 1 and not _names_dtype(node)

    def _run_key(self, node: fx.Node) -> Any:
        """The signature of re-running ``node`` now, or None when it cannot be keyed."""
        arg_key = self._arg_key
        try:
            key = (node.target, tuple([arg_key(a) for a in node.args]),
                   tuple([(k, arg_key(v)) for k, v in node.kwargs.items()]))
            hash(key)
        except (_Unkeyable, TypeError):
            return None
        return key

    def _arg_key(self, a: Any) -> Any:
        """:func:`_arg_key`; a parameter's or input's key (their values are shared by many
        ops and never re-run) is worked out once."""
        if isinstance(a, fx.Node) and a.op in ("get_attr", "placeholder"):
            val, dtype = a.meta.get("val"), dtype_of(a)
            hit = self._source_keys.get(a)
            if hit is None or hit[0] is not val or hit[1] != dtype:
                hit = self._source_keys[a] = (val, dtype, _arg_key(a))
            return hit[2]
        return _arg_key(a)

    def _run(self, node: fx.Node) -> None:
        fake_mode = self.fake_mode

        def val(a: Any) -> Any:
            if not isinstance(a, fx.Node):
                return a
            v = a.meta.get("val")
            want = dtype_of(a)
            if isinstance(v, torch.Tensor) and want is not None and v.dtype != want:
                with fake_mode:
                    v = v.to(want)
            return v

        args = tree_map(val, node.args)
        kwargs = tree_map(val, node.kwargs)
        try:
            with fake_mode:
                node.meta["val"] = node.target(*args, **kwargs)
        except Exception as exc:
            raise PassError("insert_casts", node.name,
                            f"could not re-run {op_key(node)} on the new dtypes: {exc}") from exc
        node.meta.pop("amp_dtype", None)
        _set_dtype(node, dtype_of(node))


def _sees_captured_inputs(node: fx.Node, swap: Mapping[fx.Node, fx.Node]) -> bool:
    """Every input of ``node`` is what it was at capture: the captured node itself, or a
    cast of it back to its captured dtype, with the captured value and that dtype. The
    node's own captured value then still holds (a re-run would rebuild it)."""
    if node.meta.get("val") is not node.meta.get("amp_orig_val"):
        return False
    back = {new: old for old, new in swap.items()}
    for a in node._input_nodes:  # all_input_nodes without its copy, same order
        orig = back.get(a, a)
        if orig is not a and not (a.meta.get("amp_cast") and a.args[0] is orig):
            return False  # a folded cast: the value of another node
        val = a.meta.get("val")
        if type(val) is not FakeTensor or val is not orig.meta.get("amp_orig_val") \
                or a.meta.get("amp_dtype", val.dtype) != val.dtype:
            return False
    return True


def _arg_key(a: Any) -> Any:
    """An argument as a re-run would see it: a node as its value's signature and dtype."""
    if isinstance(a, fx.Node):
        return (_sig(a.meta.get("val")), dtype_of(a))
    if isinstance(a, _SCALARS):
        return (type(a), a)
    if isinstance(a, (tuple, list)):
        return (type(a), tuple([_arg_key(v) for v in a]))
    raise _Unkeyable


def _val_sig(value: Any) -> Any:
    try:
        return _sig(value)
    except (_Unkeyable, TypeError):
        return None


def fold_casts(gm: fx.GraphModule, recompile: bool = True) -> PassResult:
    """Fold cast chains: casts to the producer's own dtype vanish, ``low -> fp32 -> low``
    becomes the original low value. ``fp32 -> low -> fp32`` is kept: it changes values.
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


def count_casts(gm: fx.GraphModule) -> int:
    return sum(1 for n in gm.graph.nodes if n.meta.get("amp_cast"))
