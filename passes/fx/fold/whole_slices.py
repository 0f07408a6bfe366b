"""``skip_whole_slices``: the users of a slice of a whole dimension read its input."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult, visiting


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
    for node in visiting(gm.graph.find_nodes(op="call_function", target=_SLICE)):
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
