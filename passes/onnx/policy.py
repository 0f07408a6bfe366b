"""ONNX op classes for the precision painter, as data.

Keys are plain ONNX op types (``MatMul``, ``Softmax``); contrib ops of other domains
(``com.microsoft`` ``Attention``, ``FusedMatMul`` ...) use their op type too. The
classes and the NORM group follow ``passes.policy`` so that the same level table and
``keep_norm_fp32`` switch apply as in the FX pass (``passes.fx.policy``). Ops not listed
are INFER; :func:`make_policy` builds a policy over this table.

Besides the classes, this module lists the input slots that must stay FP32 whatever
the node's precision (Resize scales, Range bounds, GroupNorm gamma/beta ...), the
selection ops for which clamping an out-of-range constant is exact, and the dtypes.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from onnx import TensorProto

from passes.policy import (
    ALLOW,
    CLEAR,
    DENY,
    FP32_ONLY,
    NORM,
    SELECTION,
    SELECTION_REASON,
    LevelPolicy,
    OpGroup,
    OpTable,
    op_group,
)
from passes.policy import make_policy as make_dialect_policy

ONNX_GROUPS: tuple[OpGroup, ...] = (
    op_group(
        "matmul", ALLOW,
        "matrix multiply: Tensor Cores run it several times faster and accumulate in fp32",
        "MatMul Gemm Einsum FusedMatMul FusedGemm",
    ),
    op_group(
        "conv", ALLOW,
        "convolution: Tensor Cores run it several times faster and accumulate in fp32",
        "Conv ConvTranspose FusedConv NhwcConv",
    ),
    op_group(
        "attention", ALLOW,
        "fused attention: matmul-bound, its kernels keep softmax statistics in fp32",
        "Attention MultiHeadAttention GroupQueryAttention PackedAttention "
        "PackedMultiHeadAttention DecoderMaskedMultiHeadAttention",
    ),
    op_group(
        "rnn", ALLOW,
        "recurrent cells: a matmul per step dominates",
        "LSTM GRU RNN PRelu",
    ),
    op_group(
        NORM, DENY,
        "normalisation: mean/variance statistics lose precision in 16 bits",
        "BatchNormalization LayerNormalization GroupNormalization InstanceNormalization "
        "RMSNormalization SimplifiedLayerNormalization SkipLayerNormalization "
        "SkipSimplifiedLayerNormalization LpNormalization MeanVarianceNormalization LRN "
        "GroupNorm SkipGroupNorm EmbedLayerNormalization",
    ),
    op_group(
        "softmax", DENY,
        "softmax family: exp of large logits overflows and the normalising sum loses precision",
        "Softmax LogSoftmax",
    ),
    op_group(
        "loss", DENY,
        "loss: computed in fp32 so small per-sample losses survive",
        "SoftmaxCrossEntropyLoss NegativeLogLikelihoodLoss",
    ),
    op_group(
        "transcendental", DENY,
        "|f(x)| can be far larger or smaller than |x|: the result leaves the 16-bit range",
        "Exp Log Pow Reciprocal Softplus Sinh Cosh Tan Acos Asin Acosh Asinh Atanh",
    ),
    op_group(
        "reduction", DENY,
        "large reduction: a 16-bit accumulator drops the small terms",
        "ReduceSum ReduceMean ReduceProd ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp "
        "ReduceSumSquare CumSum",
    ),
    op_group(
        FP32_ONLY, DENY,
        "Fourier transforms: onnxruntime's DFT and STFT kernels take float and double only; "
        "fp32 at every level",
        "DFT STFT",
    ),
    op_group(
        "index", DENY,
        "computes counts or coordinates: 16-bit rounding changes the number of elements",
        "Range",
    ),
    op_group(
        "data", CLEAR,
        "moves or selects data without arithmetic: follows its neighbours' precision",
        "Reshape Transpose Squeeze Unsqueeze Flatten Concat Split Slice Gather GatherElements "
        "GatherND Expand Pad Identity MaxPool GlobalMaxPool Relu Tile Where Max Min "
        "DepthToSpace SpaceToDepth Resize Upsample ScatterND ScatterElements Scatter "
        "Compress ReverseSequence Trilu Dropout Cast CastLike Shrink",
    ),
    op_group(SELECTION, CLEAR, SELECTION_REASON, "TopK ArgMax ArgMin"),
)

ONNX_TABLE = OpTable(ONNX_GROUPS)
# ops a level runs low (matmul-class) or lets follow their low neighbours (data moves)
LOW_CAPABLE = frozenset().union(*(g.ops for g in ONNX_GROUPS if g.cls in (ALLOW, CLEAR)))


def make_policy(
    level: str,
    *,
    keep_norm_fp32: bool | None = None,
    deny_ops: Iterable[str] = (),
    module_rules: Iterable[tuple[str, str, str]] = (),
) -> LevelPolicy:
    """The policy of one conversion over :data:`ONNX_TABLE`: ``passes.policy.make_policy``
    with the ONNX op table (arguments and errors as there; the ONNX pass forces ops to
    FP32 only).

    Example:
        >>> make_policy("O2", deny_ops=["MatMul"]).op_info("MatMul").cls
        'deny'
    """
    return make_dialect_policy(level, table=ONNX_TABLE, keep_norm_fp32=keep_norm_fp32,
                               deny_ops=deny_ops, module_rules=module_rules)

# Input slots that stay FP32 whatever the node's precision. A node whose FP32 slot shares
# a type parameter with its data input (Range, ONNX GroupNormalization) therefore runs in
# FP32 at every level, O3 included.
FP32_INPUTS: dict[str, tuple[int, ...]] = {
    "Resize": (1, 2),  # roi, scales: converting them gives INVALID_GRAPH or wrong sizes
    "Upsample": (1,),  # scales
    "Range": (0, 1, 2),  # start, limit, delta decide the element count
    "GroupNormalization": (1, 2),  # scale, bias
    "GroupNorm": (1, 2),  # com.microsoft gamma, beta
    "SkipGroupNorm": (1, 2),
    "RoiAlign": (1,),  # box coordinates
}
FP32_INPUT_REASON = "fp32-only inputs"

# Ops for which clamping an out-of-range constant input to the 16-bit range cannot change
# the result: op -> {input slot: sign the out-of-range values must have (0 = either)}.
SATURATING: dict[str, dict[int, int]] = {
    "Where": {1: 0, 2: 0},  # selection: masked_fill(mask, finfo.min) keeps meaning
    "Max": {i: -1 for i in range(8)},  # max(x, -1e9) == max(x, -65504) for finite fp16 x
    "Min": {i: 1 for i in range(8)},
    "Clip": {1: -1, 2: 1},
}
# Ops that pass values through unchanged: range checks look through them to the consumer.
DATA_MOVES = frozenset(
    "Reshape Transpose Squeeze Unsqueeze Flatten Concat Split Slice Gather GatherElements "
    "GatherND Expand Identity Tile DepthToSpace SpaceToDepth Compress ReverseSequence".split()
)

# Control flow: their subgraph interfaces keep the original dtypes.
CONTROL_FLOW = frozenset({"If", "Loop", "Scan"})

FLOAT = TensorProto.FLOAT
FLOAT16 = TensorProto.FLOAT16
BFLOAT16 = TensorProto.BFLOAT16
FLOAT_TYPES = frozenset({FLOAT, FLOAT16, BFLOAT16})

LOW_DTYPES: dict[str, int] = {
    "fp16": FLOAT16,
    "float16": FLOAT16,
    "half": FLOAT16,
    "bf16": BFLOAT16,
    "bfloat16": BFLOAT16,
}
DTYPE_TAG = {FLOAT: "fp32", FLOAT16: "fp16", BFLOAT16: "bf16"}
TYPE_STR = {
    "tensor(float)": FLOAT,
    "tensor(float16)": FLOAT16,
    "tensor(bfloat16)": BFLOAT16,
}


def dtype_limits(dtype: int) -> tuple[float, float]:
    """Largest finite value and smallest positive (subnormal) value of a float dtype.

    Example:
        >>> dtype_limits(TensorProto.FLOAT16)
        (65504.0, 5.960464477539063e-08)
    """
    if dtype == FLOAT16:
        return float(np.finfo(np.float16).max), float(2.0**-24)
    if dtype == BFLOAT16:
        return float.fromhex("0x1.fep127"), float(2.0**-133)
    return float(np.finfo(np.float32).max), float(np.finfo(np.float32).smallest_subnormal)


__all__ = [
    "BFLOAT16",
    "CONTROL_FLOW",
    "DATA_MOVES",
    "FLOAT",
    "FLOAT16",
    "FLOAT_TYPES",
    "FP32_INPUTS",
    "LOW_DTYPES",
    "ONNX_GROUPS",
    "ONNX_TABLE",
    "SATURATING",
    "dtype_limits",
    "make_policy",
]
