"""Every private torch / torch.fx internal the FX passes use, named once.

The passes read a few things torch does not promise to keep: the fake-tensor classes, the
pytree helpers, op schemas, and some private attributes of ``fx.Node``/``fx.Graph`` that
skip work public ones repeat on every call. Each is given a name here, and the passes use
only these names, so a torch upgrade that moves or renames one is fixed in this file (the
tests in ``tests/passes/fx/test_torch_internals.py`` pin each to its public meaning).

Hot paths (per node of a graph) take aliases, not wrapper functions: a C-level
``operator.attrgetter`` or an unbound method costs what the attribute access did, give or
take a call; the passes budget ~20 us per node.

(The one private non-torch internal, networkx's adjacency dicts, is used where the dataflow
graph is built: ``passes.fx.dataflow.build_dataflow``.)
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

__all__ = [
    "TORCH_OPS",
    "FakeTensor",
    "OpOverload",
    "OpOverloadPacket",
    "cast_node_name",
    "create_node_hooks",
    "detect_fake_mode",
    "enable_python_dispatcher",
    "has_symbolic_sizes_strides",
    "input_nodes",
    "op_schema",
    "overload_name",
    "relink",
    "size_hint",
    "tree_map",
]

# -- ops ------------------------------------------------------------------------------------

OpOverload = torch._ops.OpOverload
OpOverloadPacket = torch._ops.OpOverloadPacket
TORCH_OPS = (OpOverload, OpOverloadPacket)


def op_schema(op: OpOverload) -> Any:
    """The ``torch.FunctionSchema`` of an op overload (its arguments, returns, aliasing)."""
    return op._schema


def overload_name(op: OpOverload) -> str:
    """The overload's name within its packet ("default", "Tensor", ...)."""
    return op._overloadname


# -- fx.Node / fx.Graph ---------------------------------------------------------------------

# node -> its input nodes (``all_input_nodes`` without its list copy: a dict, same order)
input_nodes: Any = (operator.attrgetter("_input_nodes") if hasattr(fx.Node, "_input_nodes")
                    else operator.attrgetter("all_input_nodes"))


def _relink_public(node: fx.Node, args: tuple, kwargs: dict) -> None:
    node.args, node.kwargs = args, kwargs


# relink(node, args, kwargs): set a node's inputs with one re-link. ``_update_args_kwargs``
# is what assigning ``node.args`` does, less ``Node.__setattr__``'s re-filing of the node in
# the graph's find_nodes table (its op and target do not change).
CAN_RELINK = hasattr(fx.Node, "_update_args_kwargs")
relink: Any = fx.Node._update_args_kwargs if CAN_RELINK else _relink_public


def create_node_hooks(gm: fx.GraphModule) -> Any:
    """The create-node hooks registered on ``gm`` (they want to see a node's args)."""
    return getattr(gm, "_create_node_hooks", None)


def cast_node_name(graph: fx.Graph, target: Any) -> str | None:
    """The name candidate ``create_node`` derives for a node calling ``target``
    ("_to_copy_default"), already sanitised, or None (let create_node derive it)."""
    try:
        from torch.fx.graph import _illegal_char_regex

        return _illegal_char_regex.sub("_", graph._target_to_str(target)) or None
    except (ImportError, AttributeError):
        return None


# -- fake tensors and symbolic sizes --------------------------------------------------------

# fake tensor -> whether any of its sizes, strides or offset is symbolic
has_symbolic_sizes_strides: Any = operator.attrgetter("_has_symbolic_sizes_strides")


# enable_python_dispatcher(): a context in which ops run the Python kernels torch registers
# for them (``torch._decomp``'s ``py_impl``s), as they do while torch.export traces. Some
# ops' C++ kernels cannot take symbolic sizes (``aten.lstm.input`` calls ``numel()``) and
# export traced them through those Python decompositions.


def size_hint(d: torch.SymInt) -> Any:
    """The value a symbolic size had when captured (raises when it has no hint)."""
    return d.node.shape_env.optimization_hint(d.node.expr)
