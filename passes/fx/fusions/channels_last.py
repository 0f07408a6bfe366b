"""``channels_last_inputs``: inputs of convolutions (and then their weights) are cast
straight to channels-last."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast
from passes.fx.nodes import tensors

aten = torch.ops.aten


CONVS = {aten.conv2d.default, aten.convolution.default}
VIEWS = {aten.view.default, aten._unsafe_view.default, aten.as_strided.default}


def channels_last_inputs(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    """Let the casts of 4-D graph inputs that feed a convolution, and then those of the
    convolutions' weights, write channels-last.

    oneDNN and cuDNN run 16-bit convolutions fastest on NHWC; an NCHW input is reordered on
    every call. Writing the input cast (which copies anyway) in channels-last makes the
    convolutions, and the norms and elementwise ops that follow, run NHWC at no extra
    copy. Values are unchanged, only strides. Applied only when no graph output is 4-D
    or more (callers may ``.view`` it) and no ``view``/``as_strided`` reads a 4-D tensor
    (a view needs the strides it was written for).

    Example:
        >>> channels_last_inputs(gm, torch.bfloat16).modified  # a ResNet's image input
        True
    """
    nodes = list(gm.graph.nodes)
    out = next(n for n in reversed(nodes) if n.op == "output")
    if any(len(getattr(t, "shape", ())) >= 4 for a in out.all_input_nodes
           for t in tensors(a.meta.get("val"))):
        return PassResult(gm, False)
    for n in visiting(nodes):
        if n.op == "call_function" and n.target in VIEWS and any(
                t.dim() == 4 for t in tensors(n.args[0].meta.get("val"))):
            return PassResult(gm, False)
    inputs = [c for c in nodes if _low_4d_cast(c, low, "placeholder")
              and any(u.target in CONVS and u.args[0] is c for u in c.users)]
    # the convolutions then run NHWC, and aten reorders an NCHW 3x3 weight into a fresh
    # copy on every call: the weight casts write channels-last too
    weights = [c for c in nodes if inputs and _low_4d_cast(c, low, "get_attr") and c.users
               and all(u.target in CONVS and u.args[1] is c for u in c.users)]
    for cast in visiting(inputs + weights):
        cast.kwargs = {**cast.kwargs, "memory_format": torch.channels_last}
    return PassResult(gm, bool(inputs))


def _low_4d_cast(node: fx.Node, low: torch.dtype, source: str) -> bool:
    return (is_amp_cast(node) and node.target is CAST and dtype_of(node) == low
            and node.args[0].op == source
            and any(t.dim() == 4 for t in tensors(node.meta.get("val"))))
