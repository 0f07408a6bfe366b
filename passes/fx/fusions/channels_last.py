"""Value-preserving fusions: rewrites after cast insertion that keep every value and copy
fewer bytes.

- :func:`fuse_norm_casts`: the casts around fp32 normalisation go into the norm kernel.
- :func:`channels_last_inputs`: inputs of convolutions are cast straight to channels-last.
- :func:`sink_gather_casts`: an embedding gathers from its fp32 table and casts the rows.
- :func:`group_kv_heads`: attention on key/value heads repeated for grouped-query attention
  takes the unrepeated ones (``enable_gqa``) on the CPU.

(Rewrites that hand ops to the runtime are ``passes.fx.routing``; the probe of what a
device's kernels accept is ``passes.fx.capabilities``.)

Norms. O2 keeps batch/layer/group norm in fp32, so a low-precision activation is widened
before the norm and its result rounded back for the next low-precision op: two extra passes
over every activation. PyTorch's CPU and CUDA norm kernels accept a 16-bit input with fp32
weights (what cuDNN batch norm and Apex O2's ``keep_batchnorm_fp32`` rely on): they widen on
load, keep the statistics, the weights and the arithmetic in fp32 and round once on store.
``x16 -> cast fp32 -> norm -> [relu] -> cast x16`` therefore becomes ``x16 -> norm -> [relu]``
with the same numbers: widening is exact, the norm still computes in fp32, and the single
rounding on store is the one the removed cast made (relu, max pooling, and hardtanh with
bounds exact in the low dtype, commute with rounding). The backward rounds the input gradient
once, as the removed cast's backward did. The fusion applies only where every use of the
norm's output wanted the low dtype, and only for kernels a probe on the graph's device shows
to accept the mix; the norm keeps ``amp_precision == "fp32"`` and gains ``meta["amp_io"]``.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from passes._infra import PassResult
from passes.fx._torch_internals import size_hint
from passes.fx.capabilities import _mixed_io_supported
from passes.fx.dtypes import CAST, dtype_of, is_amp_cast
from passes.fx.graph import SHORT_NAMES, tensors
from passes.policy import FP32, LOW

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
    """
    nodes = list(gm.graph.nodes)
    out = next(n for n in reversed(nodes) if n.op == "output")
    if any(len(getattr(t, "shape", ())) >= 4 for a in out.all_input_nodes
           for t in tensors(a.meta.get("val"))):
        return PassResult(gm, False)
    for n in nodes:
        if n.op == "call_function" and n.target in VIEWS and any(
                t.dim() == 4 for t in tensors(n.args[0].meta.get("val"))):
            return PassResult(gm, False)
    inputs = [c for c in nodes if _low_4d_cast(c, low, "placeholder")
              and any(u.target in CONVS and u.args[0] is c for u in c.users)]
    # the convolutions then run NHWC, and aten reorders an NCHW 3x3 weight into a fresh
    # copy on every call: the weight casts write channels-last too
    weights = [c for c in nodes if inputs and _low_4d_cast(c, low, "get_attr") and c.users
               and all(u.target in CONVS and u.args[1] is c for u in c.users)]
    for cast in inputs + weights:
        cast.kwargs = {**cast.kwargs, "memory_format": torch.channels_last}
    return PassResult(gm, bool(inputs))


def _low_4d_cast(node: fx.Node, low: torch.dtype, source: str) -> bool:
    return (is_amp_cast(node) and node.target is CAST and dtype_of(node) == low
            and node.args[0].op == source
            and any(t.dim() == 4 for t in tensors(node.meta.get("val"))))
