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
    for node in list(gm.graph.nodes):
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
    if out is None or not _mixed_io_supported(norm.target, _device(norm), low):
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
        elif _exact_under_rounding(user, node, low):
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


def _device(node: fx.Node) -> torch.device | None:
    ts = tensors(node.meta.get("val"))
    return ts[0].device if ts else None


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


GATHERS = {aten.embedding.default}


def sink_gather_casts(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    """``embedding(cast(W), ids)`` becomes ``cast(embedding(W, ids))`` when the lookup is
    smaller than the table: a gather does no arithmetic, so the values are the same, but
    only the rows used are cast, and the table's gradient is made in fp32 directly instead
    of in ``low`` and then converted.

    Example:
        >>> sink_gather_casts(gm, torch.bfloat16).modified
        True
    """
    modified = False
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in GATHERS:
            continue
        cast = node.args[0]
        if not (is_amp_cast(cast) and cast.target is CAST and dtype_of(cast) == low
                and cast.args[0].op == "get_attr" and len(cast.users) == 1):
            continue
        table, out = _numel(cast.args[0]), _numel(node)
        if table is None or out is None or out >= table:
            continue
        node.args = (cast.args[0], *node.args[1:])
        gm.graph.erase_node(cast)
        with gm.graph.inserting_after(node):
            narrow = gm.graph.call_function(CAST, (node,), {"dtype": low})
        node.replace_all_uses_with(narrow, delete_user_cb=lambda u, n=narrow: u is not n)
        narrow.meta.update(amp_cast=True, amp_precision="n/a", val=node.meta.get("val"),
                           amp_dtype=low, amp_reason=f"cast torch.float32 -> {low}")
        if "nn_module_stack" in node.meta:
            narrow.meta["nn_module_stack"] = node.meta["nn_module_stack"]
        node.meta.update(amp_dtype=torch.float32, amp_precision=FP32, amp_reason=(
            f"gathers from the fp32 table ({table} elements) and casts its smaller "
            f"output ({out}): same values, fewer bytes cast"))
        modified = True
    return PassResult(gm, modified)


def _numel(node: fx.Node) -> int | None:
    """Elements of a node's single tensor output at the captured sizes, or None."""
    ts = tensors(node.meta.get("val"))
    if len(ts) != 1:
        return None
    n = 1
    for d in ts[0].shape:
        if not isinstance(d, int):
            try:
                d = size_hint(d)
            except Exception:  # unbacked or hint-less sizes
                return None
        n *= int(d)
    return n


ATTENTION = aten.scaled_dot_product_attention.default
RESHAPES = {aten.reshape.default, aten.view.default, aten._unsafe_view.default}


def group_kv_heads(gm: fx.GraphModule) -> PassResult:
    """``sdpa(q, repeat(k, n), repeat(v, n))`` becomes ``sdpa(q, k, v, enable_gqa=True)`` on
    the CPU, ``repeat`` being HF's ``repeat_kv`` (``x[:, :, None].expand(b, h, n, s, d)
    .reshape(b, h * n, s, d)``; a captured HF model passes its mask, and HF repeats the
    heads whenever there is one). The outputs are the same (query head ``i`` reads key head
    ``i // n`` either way; the key and value gradients are summed over each group before
    their one rounding, not after), but the repeated keys and values are never copied
    (docs/performance.md#grouped-query-attention). The pipeline runs it only for a runtime that
    asks for it (``RuntimeOps.unrepeated_kv_heads``: CUDA's kernels run a masked grouped
    attention on the math path). (The runtime's unfused kernel repeats the
    heads itself: ``ampgraph.runtime.cpu.attention``.)

    Example:
        >>> group_kv_heads(gm).modified
        True
    """
    modified = False
    for node in list(gm.graph.find_nodes(op="call_function", target=ATTENTION)):
        first = node.args[0] if node.args else None
        q = tensors(first.meta.get("val")) if isinstance(first, fx.Node) else ()
        if len(node.args) < 3 or node.kwargs.get("enable_gqa") or not q:
            continue
        key, value = _repeated(node.args[1]), _repeated(node.args[2])
        if key is None or value is None or key[1] != value[1] or len(q[0].shape) != 4 \
                or not statically_known_true(q[0].shape[1] == key[2]):
            continue  # grouped attention needs the query's own heads: no broadcast one
        node.update_arg(1, key[0])
        node.update_arg(2, value[0])
        node.update_kwarg("enable_gqa", True)
        modified = True
    return PassResult(gm, modified)


def _repeated(node: fx.Node) -> tuple[fx.Node, int, Any] | None:
    """``(x, n, heads)`` when ``node`` is ``x`` (4-D) with each head repeated ``n`` times in
    place (unsqueeze at 2, expand that dimension to ``n``, merge it into the ``heads``)."""
    if node.op != "call_function" or node.target not in RESHAPES:
        return None
    expand = node.args[0]
    if expand.op != "call_function" or expand.target is not aten.expand.default:
        return None
    unsqueeze = expand.args[0]
    if unsqueeze.op != "call_function" or unsqueeze.target is not aten.unsqueeze.default \
            or unsqueeze.args[1] not in (2, -3):
        return None
    x = unsqueeze.args[0]
    shapes = [tensors(n.meta.get("val")) for n in (x, expand, node)]
    if not all(len(t) == 1 for t in shapes):
        return None
    xs, es, rs = (t[0].shape for t in shapes)
    n = es[2] if len(es) == 5 else None
    if len(xs) != 4 or len(rs) != 4 or not isinstance(n, int):
        return None
    same = [(es[0], xs[0]), (es[1], xs[1]), (es[3], xs[2]), (es[4], xs[3]),
            (rs[0], xs[0]), (rs[1], xs[1] * n), (rs[2], xs[2]), (rs[3], xs[3])]
    if not all(statically_known_true(a == b) for a, b in same):
        return None
    return x, n, rs[1]
