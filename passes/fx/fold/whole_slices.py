"""Cast folding after cast insertion, duplicate and dead ops, and the count of the casts a
graph holds."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult
from passes.fx._torch_internals import OpOverload, op_schema
from passes.fx.dtypes import CAST, _widening, dtype_of, is_amp_cast
from passes.fx.graph import is_view


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
