"""``fuse_norm_casts``: the casts around fp32 normalisation go into the norm kernel.

O2 keeps batch/layer/group norm in fp32, so a low-precision activation is widened
before the norm and its result rounded back for the next low-precision op: two extra passes
over every activation. PyTorch's CPU and CUDA norm kernels accept a 16-bit input with fp32
weights (what cuDNN batch norm and Apex O2's ``keep_batchnorm_fp32`` rely on): they widen on
load, keep the statistics, the weights and the arithmetic in fp32 and round once on store.
``x16 -> cast fp32 -> norm -> [relu] -> cast x16`` therefore becomes ``x16 -> norm -> [relu]``
with the same numbers: widening is exact, the norm still computes in fp32, and the single
rounding on store is the one the removed cast made (relu, max pooling, and hardtanh with
bounds exact in the low dtype, commute with rounding, and so does a view: GPT-2's
``view(-1, d)`` and a classifier's ``select`` of the first token sit between the norm and
the cast). The backward rounds the input gradient
once, as the removed cast's backward did. The fusion applies only where every use of the
norm's output wanted the low dtype, and only for kernels a probe on the graph's device shows
to accept the mix (``passes.fx.capabilities``); the norm keeps ``amp_precision == "fp32"``
and gains ``meta["amp_io"]``.
"""

from __future__ import annotations

import operator

import torch
from torch import fx

from passes._infra import PassResult, visiting
from passes.fx._torch_internals import OpOverload, op_schema
from passes.fx.capabilities import mixed_io_supported
from passes.fx.dtypes import dtype_of, is_amp_cast
from passes.fx.nodes import SHORT_NAMES, tensors
from passes.policy import FP32, LOW

aten = torch.ops.aten


SINGLE = {aten.batch_norm.default, aten.layer_norm.default, aten.group_norm.default}
TUPLE = {aten.native_layer_norm.default, aten.native_batch_norm.default,
         aten._native_batch_norm_legit_functional.default,
         aten._native_batch_norm_legit_no_training.default,
         aten.native_group_norm.default}
# ops that commute exactly with rounding to the low dtype: round(f(x)) == f(round(x)).
# Rounding to nearest is monotone, so max and relu commute with it; hardtanh does when its
# bounds are exact in the low dtype (checked per node).
MAX_POOLS = {aten.max_pool1d.default, aten.max_pool2d.default, aten.max_pool3d.default}
EXACT = {aten.relu.default, aten.hardtanh.default, *MAX_POOLS}


def fuse_norm_casts(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    """Feed fp32 norms their low-precision input directly and drop the casts around them.

    Example:
        >>> fuse_norm_casts(gm, torch.bfloat16).modified
        True
    """
    modified = False
    for node in visiting(list(gm.graph.nodes)):
        if node.op == "call_function" and node.meta.get("amp_precision") == FP32 \
                and (node.target in SINGLE or node.target in TUPLE):
            modified |= _fuse(gm, node, low)
    return PassResult(gm, modified)


def _fuse(gm: fx.GraphModule, norm: fx.Node, low: torch.dtype) -> bool:
    widen = norm.args[0] if norm.args else None
    refuse = norm.meta.get("amp_io") == low  # fused by an earlier run: its input is low
    if not refuse and not (is_amp_cast(widen) and dtype_of(widen) == torch.float32
                           and dtype_of(widen.args[0]) == low):
        return False
    out = _data_output(norm)
    if out is None or not mixed_io_supported(norm.target, _device(norm), low):
        return False
    found: dict[str, list[fx.Node]] = {"chain": [], "narrow": [], "widen": []}
    if not _all_uses_want_low(out, low, found):
        return False
    if not refuse:
        norm.args = (widen.args[0], *norm.args[1:])
        if not widen.users:
            gm.graph.erase_node(widen)
        norm.meta["amp_io"] = low
        norm.meta["amp_reason"] = (
            f"{norm.meta.get('amp_reason', '')}; computes in fp32 (statistics, weights) with "
            f"{SHORT_NAMES[low]} input and output: the casts around it are fused into the kernel")
    for n in (out, *found["chain"]):
        n.meta["amp_dtype"] = low
    for n in found["chain"]:
        n.meta["amp_precision"] = LOW
        n.meta["amp_reason"] = (f"clear op after {norm.name}, whose {SHORT_NAMES[low]} output it "
                                "follows (exact: commutes with rounding)")
    for cast in (*found["widen"], *found["narrow"]):  # widen first: narrows may read them
        cast.replace_all_uses_with(cast.args[0])
        gm.graph.erase_node(cast)
    return not refuse or any(found.values())


def _data_output(norm: fx.Node) -> fx.Node | None:
    """The node holding the normalised tensor (the norm itself, or its ``[0]`` getitem)."""
    if norm.target in SINGLE:
        return norm
    items = [u for u in norm.users if u.target is operator.getitem]
    zero = [u for u in items if u.args[1] == 0]
    return zero[0] if len(zero) == 1 and len(items) == len(norm.users) else None


def _all_uses_want_low(node: fx.Node, low: torch.dtype, found: dict[str, list]) -> bool:
    """Every use of ``node`` (through exact ops) is a cast to ``low``. On a graph fused
    before, the norm's output is already ``low`` and the uses may first widen it again."""
    if not node.users:
        return False
    for user in node.users:
        if is_amp_cast(user) and dtype_of(user) == low:
            found["narrow"].append(user)
        elif is_amp_cast(user) and dtype_of(user) == torch.float32 \
                and dtype_of(node) == low:
            found["widen"].append(user)
            if not _all_uses_want_low(user, low, found):
                return False
        elif _exact_under_rounding(user, node, low) or _is_view_of(user, node):
            found["chain"].append(user)
            if not _all_uses_want_low(user, low, found):
                return False
        else:
            return False
    return True


def _exact_under_rounding(user: fx.Node, src: fx.Node, low: torch.dtype) -> bool:
    if user.op != "call_function" or user.target not in EXACT or user.args[0] is not src \
            or user.kwargs or any(isinstance(a, fx.Node) for a in user.args[1:]):
        return False
    if user.target in MAX_POOLS:  # window sizes, strides, padding (by -inf), dilation
        return True
    bounds = [float(b) for b in user.args[1:]]
    return all(torch.tensor(b, dtype=low).item() == b for b in bounds)


def _is_view_of(user: fx.Node, src: fx.Node) -> bool:
    """Whether ``user`` is an aten view of ``src`` alone (one tensor out, aliasing ``src``
    without writing it; sizes may be symbolic nodes): its values are ``src``'s, so it
    commutes with rounding."""
    if user.op != "call_function" or not isinstance(user.target, OpOverload) \
            or not user.args or user.args[0] is not src:
        return False
    returns = op_schema(user.target).returns
    if len(returns) != 1 or str(returns[0].type) != "Tensor":
        return False
    alias = returns[0].alias_info
    others = [a for a in (*user.args[1:], *user.kwargs.values()) if isinstance(a, fx.Node)]
    return alias is not None and not alias.is_write and not any(
        tensors(a.meta.get("val")) for a in others)


def _device(node: fx.Node) -> torch.device | None:
    ts = tensors(node.meta.get("val"))
    return ts[0].device if ts else None
