"""The rewritten graph handed to ``torch.compile`` (``ampgraph.compile(..., backend=...)``).

:func:`compiled_runner` makes what ``AmpModule`` calls, ``runner(args, kwargs)`` -> the
graph's flat outputs. The compiled code calls none of the runtime's Python; the runtime
does the graph's edges around it instead (:meth:`~ampgraph.runtime.Runtime.compiled_edges`),
each call running a split of the graph (:func:`split_edges`) compiled on its first call:

- without gradients (inference): each parameter cast becomes an input, given the runtime's
  kept low-precision copy (made again only when its master changes, where the whole graph
  casts every weight on every call); the casts of the outputs back to their dtype
  (``keep_io_types``) come after the compiled code, the runtime's (into kept buffers
  where a fresh output would fault its pages in), and an output that is a linear's product
  cast back (a language model's logits) is the runtime's linear, into kept buffers too;
- with gradients: only the outputs' casts back leave (differentiable; the weights' casts
  stay in the graph, whose backward converts their gradients).

Where the runtime does none of this (``CompiledEdges()``: the aten and CUDA runtimes), or
the graph has no such edge, a call runs the whole graph. The values are the whole graph's:
the same casts and products, made elsewhere. The user's options (``compile_options``,
checked by :func:`parse_compile_options`) go to every ``torch.compile`` call; ``dynamic``
is True unless they say otherwise (batch and sequence sizes stay dynamic, as in the
captured graph). Measured: docs/performance.md#the-compiler-route.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn
from torch.fx import _pytree as fx_pytree

from ampgraph.runtime.base import CompiledEdges, Runtime
from passes.fx.dtypes import CAST, is_amp_cast

_LINEAR = torch.ops.aten.linear.default


@dataclass
class EdgeSplit:
    """A graph without its edges (see the module docstring).

    Attributes:
        gm: the part that is compiled: the graph's flat inputs, then one input per
            lifted weight; it returns the values the slots read.
        in_spec: the whole graph's input spec (how ``(args, kwargs)`` flatten).
        weights: per lifted weight, ``(parameter, dtype, memory_format)`` of its cast.
        slots: per output of the whole graph, where it comes from: ``("out", j)`` the
            part's output ``j``; ``("cast", j, dtype)`` it cast back by the runtime;
            ``("linear", j, k, k_bias, dtype)`` the runtime's linear of output ``j`` and
            lifted weights ``k`` (and ``k_bias``, or None), cast back.
    """

    gm: fx.GraphModule
    in_spec: Any
    weights: list[tuple[nn.Parameter, torch.dtype, torch.memory_format | None]]
    slots: list[tuple]

    def leaves(self, args: tuple, kwargs: dict) -> list[Any]:
        """The call's inputs flattened as the whole graph flattens them."""
        return fx_pytree.tree_flatten_spec(([args, kwargs], {}), self.in_spec)

    def outputs(self, flat: Any, weights: list[torch.Tensor], edges: CompiledEdges) -> tuple:
        """The whole graph's outputs from the part's, the runtime doing the edges."""
        result = []
        for slot_index, slot in enumerate(self.slots):
            if slot[0] == "out":
                result.append(flat[slot[1]])
            elif slot[0] == "cast":
                result.append(edges.output_cast(flat[slot[1]], slot[2], slot_index))
            else:
                _, j, k, k_bias, dtype = slot
                bias = None if k_bias is None else weights[k_bias]
                result.append(edges.output_linear(flat[j], weights[k], bias, dtype, slot_index))
        return tuple(result)


def split_edges(gm: fx.GraphModule, edges: CompiledEdges) -> EdgeSplit | None:
    """``gm`` (a captured graph after the passes) without the edges ``edges`` takes: its
    parameter casts as inputs (with ``weight_copy``), its outputs' casts back (with
    ``output_cast``) and the linears whose products only such a cast reads (with
    ``output_linear`` too) left out; None when there is no such edge.

    Example:
        >>> split_edges(gm, CpuRuntime().compiled_edges()).weights  # doctest: +SKIP
        [(Parameter(...), torch.bfloat16, None), ...]
    """
    graph = gm.graph
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    values = output.args[0]
    if not isinstance(values, (tuple, list)) or getattr(gm, "_in_spec", None) is None:
        return None
    lifted: dict[fx.Node, int] = {}
    weights = []
    if edges.weight_copy is not None:
        for node in graph.nodes:
            param = _cast_parameter(gm, node)
            if param is not None:
                lifted[node] = len(weights)
                weights.append((param, node.kwargs["dtype"], node.kwargs.get("memory_format")))
    emitted: list[Any] = []  # what the part returns
    slots: list[tuple] = []
    left_out: set[fx.Node] = set()
    for value in values:
        if edges.output_cast is None or not _output_cast(value, output):
            slots.append(("out", len(emitted)))
            emitted.append(value)
            continue
        dtype, product = value.kwargs["dtype"], value.args[0]
        operands = _output_linear(product, value, lifted) if edges.output_linear else None
        left_out.add(value)
        if operands is None:
            slots.append(("cast", len(emitted), dtype))
            emitted.append(product)
        else:
            x, w, b = operands
            slots.append(("linear", len(emitted), lifted[w], lifted.get(b), dtype))
            emitted.append(x)
            left_out.add(product)
    if not lifted and not left_out:
        return None
    part = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = part.node_copy(node, env.__getitem__)
    for cast, k in lifted.items():
        env[cast] = part.placeholder(f"amp_weight_{k}")
        env[cast].meta.update(cast.meta)
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or node in env or node in left_out:
            continue
        if node.op == "get_attr" and node.users and all(u in lifted for u in node.users):
            continue  # a parameter read only by its lifted casts
        env[node] = part.node_copy(node, env.__getitem__)
    part.output(tuple(env[v] if isinstance(v, fx.Node) else v for v in emitted))
    return EdgeSplit(fx.GraphModule(gm, part), gm._in_spec, weights, slots)


def _cast_parameter(gm: fx.GraphModule, node: fx.Node) -> nn.Parameter | None:
    """The parameter ``node`` casts, if it is an amp cast of one (a dtype and maybe a
    memory format: a cached copy can stand for it)."""
    if not (is_amp_cast(node) and node.target is CAST and node.args
            and isinstance(node.args[0], fx.Node) and node.args[0].op == "get_attr"
            and "dtype" in node.kwargs and set(node.kwargs) <= {"dtype", "memory_format"}):
        return None
    try:
        value = gm.get_parameter(node.args[0].target)
    except AttributeError:  # a buffer or a constant: it may change inside the graph
        return None
    return value if isinstance(value, nn.Parameter) else None


def _output_cast(value: Any, output: fx.Node) -> bool:
    """Whether ``value`` is an amp cast (to a dtype, nothing else) that only the output reads."""
    return (is_amp_cast(value) and value.target is CAST and set(value.users) == {output}
            and set(value.kwargs) == {"dtype"} and len(value.args) == 1)


def _output_linear(product: Any, cast: fx.Node, lifted: Mapping[fx.Node, int]
                   ) -> tuple[fx.Node, fx.Node, fx.Node | None] | None:
    """``(x, w, b)`` when ``product`` is ``aten.linear(x, w, b)`` on lifted weights that
    only the output's ``cast`` reads; else None."""
    if not (isinstance(product, fx.Node) and product.op == "call_function"
            and product.target is _LINEAR and set(product.users) == {cast}
            and not product.kwargs and 2 <= len(product.args) <= 3):
        return None
    x, w, *rest = product.args
    b = rest[0] if rest else None
    if not isinstance(x, fx.Node) or w not in lifted or (b is not None and b not in lifted):
        return None
    return x, w, b


COMPILE_OPTIONS = ("mode", "options", "dynamic", "fullgraph")  # torch.compile's, by name


def parse_compile_options(options: Any, backend: Any) -> dict[str, Any]:
    """The user's ``compile_options`` checked against ``torch.compile``'s: a dict of
    :data:`COMPILE_OPTIONS`, given with a backend; ``mode`` (one of inductor's modes) and
    ``options`` (inductor's config names) only with ``backend="inductor"``, not both.

    Raises:
        TypeError, ValueError: what was wrong and what to pass instead.

    Example:
        >>> parse_compile_options({"mode": "max-autotune"}, "inductor")
        {'mode': 'max-autotune'}
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise TypeError(f"compile_options must be a dict of torch.compile's keyword "
                        f"arguments such as {{'mode': 'max-autotune'}}, got "
                        f"{type(options).__name__}")
    options = dict(options)
    if not options:
        return options
    if backend is None:
        raise ValueError(f"compile_options {options} are torch.compile's, but backend is None "
                         "(the graph runs eagerly): pass backend='inductor' too, or drop them")
    unknown = sorted(str(k) for k in options if k not in COMPILE_OPTIONS)
    if unknown:
        hint = " (the backend is ampgraph.compile's own backend= argument)" \
            if "backend" in unknown else ""
        raise ValueError(f"compile_options: unknown key(s) {', '.join(unknown)}{hint}: "
                         f"choose from {', '.join(COMPILE_OPTIONS)}")
    for key in ("dynamic", "fullgraph"):
        if key in options and options[key] not in ((None, True, False) if key == "dynamic"
                                                   else (True, False)):
            raise TypeError(f"compile_options[{key!r}] = {options[key]!r}: torch.compile takes "
                            + ("True, False or None" if key == "dynamic" else "True or False"))
    inductor = [k for k in ("mode", "options") if options.get(k) is not None]
    if inductor and backend != "inductor":
        raise ValueError(f"compile_options[{inductor[0]!r}] configures inductor, but backend is "
                         f"{backend!r}, which ignores it: use backend='inductor' or drop it")
    if len(inductor) == 2:
        raise ValueError("compile_options: give 'mode' or 'options', not both (torch.compile "
                         "takes one): a mode is a named set of inductor options")
    if options.get("mode") is not None:
        from torch._inductor import list_mode_options  # inductor itself: only when asked

        modes = sorted(list_mode_options())
        if options["mode"] not in modes:
            raise ValueError(f"compile_options['mode'] = {options['mode']!r}: choose one of "
                             f"{', '.join(modes)}")
    if options.get("options") is not None:
        from torch._inductor import list_options

        if not isinstance(options["options"], Mapping):
            raise TypeError("compile_options['options'] must be a dict of inductor config "
                            "names and values, such as {'max_autotune': True}")
        known = set(list_options())
        unknown = sorted(str(k) for k in options["options"] if k not in known)
        if unknown:
            raise ValueError(f"compile_options['options']: unknown inductor option(s) "
                             f"{', '.join(unknown)}: torch._inductor.list_options() names them")
        options["options"] = dict(options["options"])
    return options


class CompiledRunner:
    """What ``AmpModule`` calls for a graph handed to ``torch.compile``; see the module
    docstring.

    Args:
        gm: the captured graph after the passes.
        backend: the ``torch.compile`` backend.
        options: ``torch.compile``'s keyword arguments (``AmpConfig.compile_options``).
        edges: what the runtime does outside the compiled code.

    Attributes:
        with_grad, without_grad: ``(split, compiled)`` for calls with and without
            gradients; ``split`` None: ``compiled`` is the whole graph's.
    """

    def __init__(self, gm: fx.GraphModule, backend: str, options: Mapping[str, Any],
                 edges: CompiledEdges):
        kwargs = {"dynamic": True, **options}

        def compiled(split: EdgeSplit | None) -> tuple[EdgeSplit | None, Any]:
            return split, torch.compile(gm if split is None else split.gm, backend=backend,
                                        **kwargs)

        self.edges = edges
        # with gradients only the outputs' casts leave: a weight's cast is differentiated
        self.with_grad = compiled(split_edges(gm, dataclasses.replace(
            edges, weight_copy=None, output_linear=None)))
        self.without_grad = compiled(split_edges(gm, edges))

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        split, run = self.with_grad if torch.is_grad_enabled() else self.without_grad
        if split is None:
            return run(args, kwargs)
        copy = self.edges.weight_copy
        weights = [_static(copy(p, dtype, fmt)) for p, dtype, fmt in split.weights]
        flat = run(*split.leaves(args, kwargs), *weights)
        return split.outputs(flat, weights, self.edges)


def _static(t: torch.Tensor) -> torch.Tensor:
    """``t`` marked static for Dynamo (a weight's shape never changes: under
    ``dynamic=True`` its sizes would otherwise be symbols), once per tensor."""
    if t.dim() and getattr(t, "_dynamo_static_indices", None) is None:
        torch._dynamo.mark_static(t)
    return t


def compiled_runner(gm: fx.GraphModule, backend: str, options: Mapping[str, Any],
                    runtime: Runtime) -> Callable[[tuple, dict], Any]:
    """The runner of ``gm`` compiled by ``backend`` with ``torch.compile``'s ``options``,
    ``runtime`` doing its edges (a :class:`CompiledRunner`).

    Example:
        >>> runner = compiled_runner(gm, "inductor", {}, CpuRuntime())
        >>> flat = runner((x,), {})  # doctest: +SKIP
    """
    return CompiledRunner(gm, backend, options, runtime.compiled_edges())
