"""Which dimensions of a capture's inputs torch.export is asked to keep dynamic."""

from __future__ import annotations

from typing import Any

import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

from ampgraph.capture.structure import BUILTIN_NODE_TYPES


def dynamic_spec(inputs: Any) -> Any:
    """Every dimension of every tensor input may be dynamic (export specialises as needed).

    A registered pytree node that is not a built-in container (a HuggingFace cache) gets
    the list of its children's specs, which is what torch.export expects for such types.
    """
    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(x.dim())}
        if pytree.tree_is_leaf(x):
            return None
        node_type = pytree._get_node_type(x)
        node = pytree.SUPPORTED_NODES[node_type]
        children, context = node.flatten_fn(x)
        specs = [spec(c) for c in children]
        if node_type in BUILTIN_NODE_TYPES:
            return node.unflatten_fn(specs, context)
        return specs  # e.g. a cache, a ModelOutput passed back in (encoder_outputs)

    return spec(inputs)
