"""The Python that runs a captured graph once the passes are done with it.

FX writes each aten call as ``torch.ops.aten.add.Tensor(x, y)``: four attribute reads and
``OpOverload.__call__``, a Python frame whose boxed call parses the arguments against the
schema. The model's own code called ``torch.add`` instead, the binding torch generates
from the same schema, which parses in C++: on small models the difference decides the
ratio to autocast (docs/performance.md#graph-overhead-on-small-models).

- :func:`direct_runner` is the forward that ``AmpModule`` calls: the graph's code generated
  again with each aten overload that has a generated binding called through it (a global
  of the code, not an attribute path), on the same module. The graph itself keeps its
  ``OpOverload`` targets, for ``explain``, graph transforms and tests.
- :func:`shortcut_attribute_paths` (which :func:`direct_runner` runs first) makes the
  code's parameter reads plain attribute reads.

What a binding runs is what the overload runs: the generated binding of ``aten::name``
parses its arguments into one of that name's overloads and calls it through the
dispatcher. aten's overloads of one name share their semantics (``add.Tensor`` on a
wrapped number is ``add.Scalar``), so the one the binding picks computes what the graph's
did; ``tests/ampgraph/capture/test_codegen.py`` checks each call of the test models
against its overload, bit for bit, and the runner against the graph's code. Not
rewritten: factories (no tensor input: torch's Python default device and function modes
apply to bindings, not to overloads), calls passing a positional argument by keyword
(bindings may name ``self`` ``input``), bindings FX would not write as themselves (see
:func:`_emitted_as_itself`), other namespaces, and the graph's runtime calls. (The runner
is made when a graph is captured: hooks added to the graph module later, or graph edits
outside ``AmpModule.add_graph_transform``, do not reach it.)
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import fx
from torch.fx.graph_module import _forward_from_src
from torch.fx.node import _get_qualified_name

from passes.fx.checkpoints import CheckpointedRegion

# torch's generated bindings, by namespace: torch.*, torch.nn.functional's C half,
# torch.special, torch.linalg, torch.fft
_FUNCTIONS = (torch._C._VariableFunctions, torch._C._nn, torch._C._special,
              torch._C._linalg, torch._C._fft)
# overloads with no function binding whose Tensor method is generated from their schema
_METHODS = {"aten::view": "view", "aten::expand": "expand"}
_TENSOR = torch.TensorType.get()
_TENSORS = torch.ListType.ofTensors()
_ENUMS = ("ScalarType", "MemoryFormat")
_OPTIONS = {"Optional[Layout]", "Layout", "Optional[Device]", "Device"}


@functools.cache
def _binding(op: Any) -> tuple[str, Any] | None:
    """``("call_function", binding)`` or ``("call_method", name)`` for an aten overload
    called with a tensor first (None when it has no generated binding)."""
    if type(op) is not torch._ops.OpOverload or op.namespace != "aten":
        return None
    schema = op._schema
    first = schema.arguments[0].type if schema.arguments else None
    if first is None or not (first.isSubtypeOf(_TENSOR) or first.isSubtypeOf(_TENSORS)):
        return None  # a factory
    if any(str(a.real_type) in _OPTIONS for a in schema.arguments):
        return None  # layout, device, pin_memory: bindings group them as tensor options
    if schema.name in _METHODS:
        return "call_method", _METHODS[schema.name]
    name = schema.name.partition("::")[2]
    if name.startswith("__"):
        return None
    for namespace in _FUNCTIONS:
        fn = getattr(namespace, name, None)
        if fn is not None:
            return ("call_function", fn) if _emitted_as_itself(fn) else None
    return None


def _emitted_as_itself(fn: Any) -> bool:
    """Whether the name FX's code writes for ``fn`` (``torch.<name>`` for a binding whose
    module says torch) is ``fn`` itself: for some, ``torch.<name>`` is a Python wrapper of
    another signature (``torch.functional``'s ``broadcast_tensors``, ``split``,
    ``unique_consecutive``); for others FX finds no name at all (``unique_dim``)."""
    try:
        path = _get_qualified_name(fn).split(".")
        obj = importlib.import_module(path[0])
        for attr in path[1:]:
            obj = getattr(obj, attr)
    except Exception:
        return False
    return obj is fn


def _direct(node: fx.Node) -> bool:
    """Retarget ``node`` (a copy) to its binding if it has one; whether it did. Every
    argument is passed, defaults included: a binding's defaults can differ from its
    schema's (``cross_entropy_loss``'s ``reduction``: the schema's mean, the binding's
    none)."""
    if node.op != "call_function":
        return False
    if node.target is torch.ops.aten._to_copy.default:  # a cast: Tensor.to, always a copy
        if set(node.kwargs) - {"dtype", "memory_format"} or "dtype" not in node.kwargs \
                or len(node.args) != 1:
            return False
        node.op, node.target = "call_method", "to"
        node.kwargs = {**node.kwargs, "copy": True}
        return True
    found = _binding(node.target)
    if found is None:
        return False
    kwargs = {}
    for i, arg in enumerate(node.target._schema.arguments):
        if arg.kwarg_only and arg.name in node.kwargs:
            kwargs[arg.name] = node.kwargs[arg.name]
        elif i >= len(node.args) and (arg.name in node.kwargs or not _default(arg, kwargs)):
            return False  # a positional argument by keyword (``self``: ``input``)
    if set(node.kwargs) - set(kwargs):
        return False
    node.op, node.target = found
    node.kwargs = kwargs
    return True


def _default(arg: Any, kwargs: dict) -> bool:
    """Pass ``arg``'s schema default by keyword (its name in the binding too; by position a
    trailing default can select a deprecated signature: ``add.Scalar``'s ``alpha`` makes
    ``torch.add(x, other, 1)`` read as ``add(input, alpha, other)``); False where it has
    none that a binding parses alike (a dtype or memory format other than None is an
    enum's int in the schema)."""
    if not arg.has_default_value():
        return False
    value = arg.default_value
    if value is not None and any(t in str(arg.real_type) for t in _ENUMS):
        return False
    kwargs[arg.name] = value
    return True


def direct_runner(gm: fx.GraphModule) -> Callable[..., Any]:
    """``gm``'s forward, bound to ``gm``, with its aten calls made through torch's
    generated bindings (see the module docstring); ``gm`` itself where it has hooks to run
    (``nn.Module.__call__``) or nothing to rewrite. Either way the code's parameter reads
    are made plain attribute reads first (:func:`shortcut_attribute_paths`). Make it again
    after changing the graph or its submodules. The graphs of its checkpointed regions
    (``passes/fx/checkpoints.py``) get theirs too."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and isinstance(node.target, CheckpointedRegion):
            node.target.forward = direct_runner(node.target.gm)
    shortcut_attribute_paths(gm)
    if (gm._forward_pre_hooks or gm._forward_hooks or gm._forward_pre_hooks_with_kwargs
            or gm._forward_hooks_always_called):
        return gm
    graph = fx.Graph()
    graph._codegen = gm.graph._codegen  # the pytree calling convention (args, kwargs)
    rv, output = graph.graph_copy(gm.graph, {}, return_output_node=True)
    graph.output(rv, type_expr=getattr(output, "type", None))
    if not sum(_direct(node) for node in graph.nodes):
        return gm
    try:
        code = graph.python_code(root_module="self")
        forward = _forward_from_src(code.src, code.globals, getattr(gm.graph, "_co_fields", {}))
    except Exception:  # FX could not write a call: the graph's own code serves
        return gm
    return types.MethodType(forward, gm)


def shortcut_attribute_paths(gm: fx.GraphModule) -> None:
    """Put each submodule on a parameter's or buffer's path into its parent's instance
    dict, so the generated ``getattr(self.model.layers, "0").self_attn.q_proj.weight``
    reads plain attributes instead of calling ``nn.Module.__getattr__`` at every step
    (docs/performance.md#graph-overhead-on-small-models). ``nn.Module.__setattr__``
    replaces such an entry with the module it registers; ``add_module`` does not: call
    this again after changing submodules that way (:func:`direct_runner` does, which
    ``AmpModule.add_graph_transform`` calls). Parameters and buffers are still read
    through ``__getattr__`` (a buffer can be reassigned in place of its entry)."""
    for node in gm.graph.find_nodes(op="get_attr"):
        owner = gm
        for name in node.target.split(".")[:-1]:
            child = owner._modules.get(name)
            if child is None:
                break
            owner.__dict__[name] = child
            owner = child
