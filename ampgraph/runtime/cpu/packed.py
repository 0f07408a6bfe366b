"""Inference linears on weights prepacked for oneDNN's CPU kernels.

aten's CPU ``linear`` in bf16 or fp16 reorders the weight into oneDNN's blocked layout on
every call. An inference working copy lives until its master changes, so the weight cache
keeps it in that layout instead (what inductor's weight freezing does on the CPU) and calls
oneDNN's linear on it. The products are oneDNN's, as aten's (equal to aten's bit for bit on
contiguous inputs where measured; the tests allow the dtype's rounding). Faster than aten's
at every size measured (docs/performance.md#packed-inference-weights).

Only where oneDNN runs the dtype (``_is_mkldnn_bf16_supported`` / ``_fp16``), oneDNN is
enabled, and on plain CPU tensors with no derivative to record (see :func:`usable`):
anything else (torch.compile's tracing, forward-mode AD or functorch transforms, a tensor
subclass, an input or bias that requires grad) goes to ``aten.linear``. The packed layout
is chosen for the first call's number of rows; other row counts give the same products. A
weight stored ``[in, out]`` (transformers' ``Conv1D``, ``transposed=True`` in the cache) is
packed from its plain copy on the second call on an unchanged master (its reorder costs ~3x
a plain one's).
A weight keeps one inference copy for its linears, the packed or the plain one (a frozen
weight linear'd with and without input gradients, as under LoRA, swaps them); one also
cast by another node keeps that node's plain copy too.
"""

from __future__ import annotations

import functools

import torch
from torch.autograd import forward_ad


@functools.cache
def _runs(dtype: torch.dtype) -> bool:
    """Whether this CPU's oneDNN runs ``dtype`` linears (built with oneDNN, the ISA has it)."""
    if not torch.backends.mkldnn.is_available():
        return False
    supported = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported,
                 torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported}.get(dtype)
    return supported is not None and bool(supported())


def usable(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether ``linear(x, w.to(x.dtype), b)`` may run on a packed copy of the weight ``w``:
    a plain 2-D CPU weight of another dtype (a copy is made anyway: the packed one takes its
    place), a plain CPU input whose last dimension matches, outside torch.compile's tracing
    and forward-mode AD, and with nothing for autograd to record (oneDNN's op has no
    derivative: an input or bias that requires grad goes to aten, whose linear has one)."""
    return (not torch.compiler.is_compiling()
            and type(x) is torch.Tensor and type(w) in (torch.Tensor, torch.nn.Parameter)
            and x.device.type == "cpu" and w.device.type == "cpu"
            and x.layout == torch.strided and w.layout == torch.strided
            and w.dim() == 2 and w.numel() > 0 and x.dim() >= 1 and x.shape[-1] == w.shape[1]
            and w.dtype != x.dtype and _runs(x.dtype) and torch._C._get_mkldnn_enabled()
            and not (torch.is_grad_enabled() and (
                x.requires_grad or b is not None and b.requires_grad))
            and forward_ad._current_level < 0
            and not torch._C._functorch.is_functorch_wrapped_tensor(x))


def pack(w: torch.Tensor, rows: int) -> torch.Tensor:
    """``w`` (already in the low dtype) in oneDNN's layout for inputs of about ``rows`` rows
    (a hint: any number of rows gives the same products)."""
    return torch.ops.mkldnn._reorder_linear_weight(w, max(1, rows))


# An activation the runtime's linear takes (``activations.py``) -> oneDNN's post-op for it
# (its name and algorithm), computed on the fp32 accumulator before the one rounding.
EPILOGUES = {None: ("none", ""), "relu": ("relu", ""), "gelu": ("gelu", "none"),
             "gelu_tanh": ("gelu", "tanh"), "silu": ("swish", "")}


def linear(x: torch.Tensor, packed: torch.Tensor, b: torch.Tensor | None,
           activation: str | None = None) -> torch.Tensor:
    """``aten.linear(x, w, b)`` for ``packed = pack(w, ...)``; ``b`` in ``x``'s dtype; the
    ``activation`` (a key of :data:`EPILOGUES`) applied in oneDNN's epilogue, no pass of its
    own over the output (docs/performance.md#activations-in-the-linear)."""
    attr, algorithm = EPILOGUES[activation]
    return torch.ops.mkldnn._linear_pointwise(x, packed, b, attr, [], algorithm)
