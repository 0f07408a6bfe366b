"""Float8Products: the FP8 matrix product of an activation and a weight that rewritten
graphs call (``passes/fx/fp8_recipe.py`` says which products and how they are scaled).

Forward: the activation and the weight are quantized to e4m3 with power-of-two scales
computed on the device from their amax (``2**floor(log2(max / amax))``: no host sync,
and scaling commutes with rounding, so dequantizing is exact), one scale per tensor
("tensorwise") or per row of the activation and per output row of the weight
("rowwise"); ``torch._scaled_mm`` multiplies them, accumulating in fp32. Backward (an
autograd Function: ``_scaled_mm`` has none) quantizes the output gradient (e5m2
tensorwise; e4m3 rowwise, as torchao's rowwise recipe does: the rowwise kernels take
e4m3 operands only) and runs grad_input in FP8, grad_weight in FP8 or, with
``weight_grad="low"``, in the 16-bit dtype; the weight's gradient reaches its fp32
master in fp32.

The weight's FP8 copies (the forward one and the transposed one backward reads, with
their scales) are made once per step with ``cache_weights=True``: kept per master,
keyed on its version counter and storage, so every use between two optimizer steps
reuses them. Fused optimizers write the masters without bumping their version counters;
a global optimizer step hook bumps them (`fused_updates.py`, shared with the CUDA runtime). With
``cache_weights=False`` (the torch.compile path) everything is computed inline, so
inductor fuses the amax and cast work.

On devices other than CUDA the product is emulated (``emulate=None``): the FP8 operands
and power-of-two scales are exact in fp32, so dequantizing and an fp32 matmul is the same
product, rounded once; CPU ``_scaled_mm`` is correct but far too slow to use.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from ampgraph.runtime.fused_updates import see_fused_updates
from ampgraph.runtime.tensors import master_ref
from passes.fx.fp8_recipe import FORWARD_DTYPE, GRAD_DTYPE, SCALINGS, WEIGHT_GRADS

_EPS = 1e-12  # amax floor: an all-zero tensor gets a finite scale (torchao's value)
# Output gradients' dtype per scaling: the rowwise kernels take e4m3 operands only.
_GRAD_DTYPES = {"tensorwise": GRAD_DTYPE, "rowwise": FORWARD_DTYPE}


def _quantize(t: torch.Tensor, dtype: torch.dtype, dim: int | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (2-D) in ``dtype`` and its fp32 dequantization factor (the inverse scale):
    one per tensor (``dim=None``, a 0-d tensor) or one per slice along ``dim`` (kept as
    a size-1 dim)."""
    fmax = torch.finfo(dtype).max
    absolute = t.abs()
    amax = absolute.amax() if dim is None else absolute.amax(dim=dim, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(fmax / amax.float().clamp(min=_EPS))))
    q = (t.float() * scale).clamp(-fmax, fmax).to(dtype)
    return q, scale.reciprocal()


def _scaled_mm(a: torch.Tensor, b: torch.Tensor, inv_a: torch.Tensor, inv_b: torch.Tensor,
               out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``a @ b`` of FP8 operands (a row-major, b column-major), dequantized by ``inv_a``
    ((), or (M, 1)) and ``inv_b`` ((), or (1, N)), accumulated in fp32, in ``out_dtype``."""
    if emulate:  # exact operands: fp32 matmul, one rounding
        return ((a.float() * inv_a) @ (b.float() * inv_b)).to(out_dtype)
    rowwise = inv_a.dim() > 0
    kernel_dtype = torch.bfloat16 if rowwise else out_dtype  # rowwise kernels: bf16 out
    out = torch._scaled_mm(a, b, inv_a, inv_b, out_dtype=kernel_dtype)
    return out if kernel_dtype == out_dtype else out.to(out_dtype)


def _pad_rows(t: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of ``multiple`` (the FP8 kernels'
    inner dimension); zeros add nothing to a product."""
    extra = -t.shape[0] % multiple
    return t if extra == 0 else torch.cat([t, t.new_zeros(extra, *t.shape[1:])])


def _product_tn(a: torch.Tensor, inv_a: torch.Tensor, b: torch.Tensor, inv_b: torch.Tensor,
                out_dtype: torch.dtype, emulate: bool) -> torch.Tensor:
    """``a^T @ b`` of FP8 ``a`` (M, P) and ``b`` (M, Q) scaled per column (inverse scales
    () or (1, P) and (1, Q)): the weight gradient's product, inner dimension M."""
    if not emulate:
        a, b = _pad_rows(a), _pad_rows(b)
    inv_a = inv_a.reshape(-1, 1) if inv_a.dim() else inv_a  # (P, 1) with stride 1
    return _scaled_mm(a.t().contiguous(), b.t().contiguous().t(), inv_a, inv_b,
                      out_dtype, emulate)


def weight_copies(weight: torch.Tensor, scaling: str, transposed: bool
                  ) -> tuple[torch.Tensor, ...]:
    """The weight's FP8 copies: (forward (out, in), its inverse scale () or (1, out),
    backward (in, out) contiguous, its inverse scale () or (1, in)).

    Example:
        >>> w_fwd, inv, w_bwd, inv_t = weight_copies(torch.randn(32, 16), "tensorwise", False)
        >>> w_fwd.shape, w_bwd.shape
        (torch.Size([32, 16]), torch.Size([16, 32]))
    """
    w = weight.detach()
    w = w.t() if transposed else w  # (out, in)
    if scaling == "tensorwise":
        w_fwd, inv = _quantize(w.contiguous(), FORWARD_DTYPE, None)
        return w_fwd, inv, w_fwd.t().contiguous(), inv
    w_fwd, inv = _quantize(w.contiguous(), FORWARD_DTYPE, -1)  # per output row: (out, 1)
    w_bwd, inv_t = _quantize(w, FORWARD_DTYPE, 0)  # per input column: (1, in)
    return w_fwd, inv.reshape(1, -1), w_bwd.t().contiguous(), inv_t


class _Float8Linear(torch.autograd.Function):
    """``x @ W^T + b`` in FP8; ``weight`` is only read for its gradient's layout: the
    product uses the FP8 copies passed with it."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                w_fwd: torch.Tensor, w_inv: torch.Tensor, w_bwd: torch.Tensor,
                w_bwd_inv: torch.Tensor, transposed: bool, scaling: str, weight_grad: str,
                emulate: bool) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        rowwise = scaling == "rowwise"
        x_q, x_inv = _quantize(x2, FORWARD_DTYPE, -1 if rowwise else None)
        if bias is None:
            out = _scaled_mm(x_q, w_fwd.t(), x_inv, w_inv, x.dtype, emulate)
        else:
            out = (_scaled_mm(x_q, w_fwd.t(), x_inv, w_inv, torch.float32, emulate)
                   + bias.float()).to(x.dtype)
        if weight_grad == "fp8":  # the FP8 activation only, scaled per column (over M)
            if rowwise:
                x_q, x_inv = _quantize(x2, FORWARD_DTYPE, 0)
            ctx.save_for_backward(w_bwd, w_bwd_inv, x_q, x_inv)
        else:
            ctx.save_for_backward(w_bwd, w_bwd_inv, x2)
        ctx.config = (transposed, scaling, weight_grad, emulate, x.shape, x.dtype,
                      None if bias is None else bias.dtype)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple:
        transposed, scaling, weight_grad, emulate, x_shape, x_dtype, bias_dtype = ctx.config
        w_bwd, w_bwd_inv, *saved = ctx.saved_tensors
        g2 = grad_out.reshape(-1, grad_out.shape[-1]).contiguous()
        rowwise = scaling == "rowwise"
        grad_dtype = _GRAD_DTYPES[scaling]
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            g_q, g_inv = _quantize(g2, grad_dtype, -1 if rowwise else None)
            grad_x = _scaled_mm(g_q, w_bwd.t(), g_inv, w_bwd_inv, x_dtype,
                                emulate).reshape(x_shape)
        if ctx.needs_input_grad[1]:
            if weight_grad == "fp8":
                x_q, x_inv = saved
                gc_q, gc_inv = _quantize(g2, grad_dtype, 0 if rowwise else None)
                if transposed:  # stored (in, out): x^T g
                    grad_w = _product_tn(x_q, x_inv, gc_q, gc_inv, torch.float32, emulate)
                else:
                    grad_w = _product_tn(gc_q, gc_inv, x_q, x_inv, torch.float32, emulate)
            else:
                (x2,) = saved
                g_low = g2.to(x2.dtype)
                grad_w = (x2.t() @ g_low if transposed else g_low.t() @ x2).float()
        if bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = g2.float().sum(0).to(bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None, None, None


class Float8Products:
    """The FP8 products of one compiled module, with its cache of FP8 weight copies.

    Args:
        cache_weights: keep each weight's FP8 copies until its master changes (eager);
            False computes them in every call (torch.compile traces it all).
        emulate: run the product as an exact fp32 emulation; None: on devices other
            than CUDA.

    Example:
        >>> fp8 = Float8Products()
        >>> w = torch.nn.Parameter(torch.randn(32, 16))
        >>> fp8.linear(torch.randn(4, 16, dtype=torch.bfloat16), w).shape
        torch.Size([4, 32])
    """

    def __init__(self, cache_weights: bool = True, emulate: bool | None = None) -> None:
        self.cache_weights = cache_weights
        self.emulate = emulate
        self._entries: dict[tuple, list] = {}  # (id, scaling, transposed) -> [ref, key, copies]
        self._lock = threading.Lock()
        self.conversions = 0  # weight copies made (tests, benchmarks)
        if cache_weights:
            see_fused_updates()

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               *, transposed: bool = False, scaling: str = "tensorwise",
               weight_grad: str = "fp8") -> torch.Tensor:
        """``x @ weight^T + bias`` (``x @ weight + bias`` with ``transposed=True``) in FP8.

        Args:
            x: the activation in the level's 16-bit dtype, last dim ``in``.
            weight: the fp32 master, ``(out, in)``; ``(in, out)`` with ``transposed``.
            bias: the fp32 master (or a 16-bit cast of it) or None; added in fp32.
            transposed: the weight is stored ``(in, out)`` (``aten.addmm(b, x, w)``).
            scaling: "tensorwise" or "rowwise".
            weight_grad: "fp8", or "low" (the weight gradient's product 16-bit).

        Returns:
            ``(*x.shape[:-1], out)`` in ``x.dtype``; differentiable w.r.t. ``x``,
            ``weight`` (an fp32 gradient) and ``bias``.

        Example:
            >>> w = torch.nn.Parameter(torch.randn(16, 32))
            >>> x = torch.randn(4, 16, dtype=torch.bfloat16)
            >>> Float8Products().linear(x, w, transposed=True, scaling="rowwise").shape
            torch.Size([4, 32])
        """
        if scaling not in SCALINGS or weight_grad not in WEIGHT_GRADS:
            raise ValueError(f"Float8Products.linear: scaling must be one of {SCALINGS} and "
                             f"weight_grad one of {WEIGHT_GRADS}, got {scaling!r}, "
                             f"{weight_grad!r}")
        emulate = self.emulate if self.emulate is not None else x.device.type != "cuda"
        if self.cache_weights:
            copies = self.weight_copies(weight, scaling, transposed)
        else:
            copies = weight_copies(weight, scaling, transposed)
        return _Float8Linear.apply(x, weight, bias, *copies, transposed, scaling,
                                   weight_grad, emulate)

    def weight_copies(self, weight: torch.Tensor, scaling: str, transposed: bool
                      ) -> tuple[torch.Tensor, ...]:
        """:func:`weight_copies`, kept until the master's version or storage changes."""
        slot = (id(weight), scaling, transposed)
        key = (weight._version, weight.data_ptr(), weight.device, weight.shape)
        with self._lock:
            entry = self._entries.get(slot)
            if entry is None or entry[0]() is not weight:
                ref = master_ref(weight, self._entries, slot, self._lock)
                entry = self._entries[slot] = [ref, None, None]
            if entry[1] != key:
                with torch.no_grad():
                    entry[2] = weight_copies(weight, scaling, transposed)
                entry[1] = key
                self.conversions += 1
            return entry[2]

    def clear(self) -> None:
        """Drop every kept FP8 copy (after changing masters through ``p.data``)."""
        with self._lock:
            self._entries.clear()
