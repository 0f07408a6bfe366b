"""FX op classes for the precision painter, as data, and the FX dialect's policy.

Keys are aten op packets (``aten.softmax``) or overloads (``aten.softmax.int``, which win
over their packet); ``getitem`` stands for ``operator.getitem``. The classes, the level
table and the NORM group are ``passes.policy``'s, shared with the ONNX dialect. Ops not
listed are INFER.

Besides the classes, this module lists the argument slots that keep their original dtype
whatever the op's precision (batch-norm statistics).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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
    key_candidates,
    op_group,
)
from passes.policy import make_policy as make_dialect_policy

FX_GROUPS: tuple[OpGroup, ...] = (
    op_group(
        "matmul", ALLOW,
        "matrix multiply: Tensor Cores / AMX / AVX512-BF16 run it several times faster "
        "and accumulate in fp32",
        "aten.linear aten.addmm aten.mm aten.bmm aten.matmul aten.baddbmm aten.addbmm "
        "aten.addmv aten.addr aten.mv aten.einsum aten.chain_matmul aten.linalg_multi_dot "
        "aten._addmm_activation aten.bilinear",
    ),
    op_group(
        "dot", ALLOW,
        "dot products along a dimension, on torch.autocast's lower-precision lists (CPU and "
        "CUDA): the sum accumulates in fp32",
        "aten.linalg_vecdot",
    ),
    op_group(
        "conv", ALLOW,
        "convolution: Tensor Cores / AMX run it several times faster and accumulate in fp32",
        "aten.conv1d aten.conv2d aten.conv3d aten.convolution aten._convolution "
        "aten.conv_transpose1d aten.conv_transpose2d aten.conv_transpose3d "
        "aten.cudnn_convolution aten.mkldnn_convolution aten.conv_tbc",
    ),
    op_group(
        "attention", ALLOW,
        "fused attention: matmul-bound, its kernels keep softmax statistics in fp32",
        "aten.scaled_dot_product_attention aten._scaled_dot_product_flash_attention "
        "aten._scaled_dot_product_efficient_attention aten._scaled_dot_product_cudnn_attention "
        "aten._scaled_dot_product_flash_attention_for_cpu",
    ),
    op_group(
        "rnn", ALLOW,
        "recurrent cells: a matmul per step dominates",
        "aten.lstm aten.gru aten.rnn_tanh aten.rnn_relu aten.lstm_cell aten.gru_cell "
        "aten.rnn_tanh_cell aten.rnn_relu_cell aten.prelu aten._prelu_kernel",
    ),
    op_group(
        NORM, DENY,
        "normalisation: mean/variance statistics lose precision in 16 bits",
        "aten.batch_norm aten.native_batch_norm aten._native_batch_norm_legit "
        "aten._native_batch_norm_legit_functional aten._native_batch_norm_legit_no_training "
        "aten.cudnn_batch_norm aten.layer_norm aten.native_layer_norm aten.group_norm "
        "aten.native_group_norm aten.instance_norm aten.rms_norm aten._fused_rms_norm "
        "aten.local_response_norm",
    ),
    op_group(
        "softmax", DENY,
        "softmax family: exp of large logits overflows and the normalising sum loses precision",
        "aten.softmax aten._softmax aten.log_softmax aten._log_softmax aten._safe_softmax",
    ),
    op_group(
        "loss", DENY,
        "loss: computed in fp32 so small per-sample losses and their gradients survive",
        "aten.cross_entropy_loss aten.nll_loss aten.nll_loss2d aten.nll_loss_nd "
        "aten.nll_loss_forward aten.mse_loss aten.l1_loss aten.smooth_l1_loss aten.huber_loss "
        "aten.binary_cross_entropy aten.binary_cross_entropy_with_logits aten.kl_div "
        "aten.soft_margin_loss aten.multilabel_margin_loss aten.margin_ranking_loss "
        "aten.hinge_embedding_loss aten.cosine_embedding_loss aten.poisson_nll_loss "
        "aten.ctc_loss aten.multi_margin_loss aten.triplet_margin_loss",
    ),
    op_group(
        "transcendental", DENY,
        "|f(x)| can be far larger or smaller than |x|: the result leaves the 16-bit range",
        "aten.exp aten.exp2 aten.expm1 aten.log aten.log10 aten.log1p aten.log2 aten.pow "
        "aten.reciprocal aten.rsqrt aten.sinh aten.cosh aten.tan aten.acos aten.asin "
        "aten.erfinv aten.softplus aten.xlogy aten.special_xlog1py aten.logit",
    ),
    op_group(
        "reduction", DENY,
        "large reduction: a 16-bit accumulator drops the small terms",
        "aten.sum aten.mean aten.prod aten.cumsum aten.cumprod aten.norm "
        "aten.linalg_vector_norm aten.linalg_norm aten.frobenius_norm aten.var aten.std "
        "aten.var_mean aten.std_mean aten.logsumexp aten.logcumsumexp aten.nansum "
        "aten.nanmean aten.dist aten.cdist aten._cdist_forward aten.pdist aten.renorm "
        "aten.cosine_similarity",
    ),
    op_group(
        FP32_ONLY, DENY,
        "complex numbers and FFTs: no bfloat16 kernels (complex32 and cuFFT's half only at "
        "powers of two); fp32 at every level, as autocast keeps them",
        "aten.view_as_complex aten.complex aten.polar aten.fft_fft aten.fft_ifft "
        "aten.fft_fft2 aten.fft_ifft2 aten.fft_fftn aten.fft_ifftn aten.fft_rfft "
        "aten.fft_irfft aten.fft_rfft2 aten.fft_irfft2 aten.fft_rfftn aten.fft_irfftn "
        "aten.fft_hfft aten.fft_ihfft aten.fft_hfft2 aten.fft_ihfft2 aten.fft_hfftn "
        "aten.fft_ihfftn aten._fft_r2c aten._fft_c2r aten._fft_c2c aten.stft aten.istft",
    ),
    op_group(
        FP32_ONLY, DENY,
        "a call kept out of the graph (a user's autograd.Function, a submodule with hooks): "
        "it runs as written, on fp32 inputs as the fp32 model gave it, with its own backward",
        "ampgraph.opaque",
    ),
    op_group(
        FP32_ONLY, DENY,
        "linear algebra (factorisations, solves, inverses, matrix exponentials): no 16-bit "
        "kernels on the CPU, and the precision they exist for; fp32 at every level",
        "aten.linalg_householder_product aten.orgqr aten.ormqr aten.geqrf aten.linalg_qr "
        "aten.qr aten.linalg_matrix_exp aten.matrix_exp aten.linalg_solve aten.linalg_solve_ex "
        "aten._linalg_solve_ex aten.linalg_inv aten.linalg_inv_ex aten.inverse "
        "aten.linalg_eigh aten._linalg_eigh aten.linalg_eig aten.linalg_eigvals "
        "aten.linalg_eigvalsh aten.linalg_svd aten._linalg_svd aten.svd aten.linalg_svdvals "
        "aten.linalg_cholesky aten.linalg_cholesky_ex aten.cholesky aten.cholesky_solve "
        "aten.cholesky_inverse aten.linalg_det aten._linalg_det aten.det aten.logdet "
        "aten.linalg_slogdet aten._linalg_slogdet aten.slogdet aten.linalg_lu "
        "aten.linalg_lu_factor aten.linalg_lu_factor_ex aten.linalg_lu_solve aten.lu_unpack "
        "aten.triangular_solve aten.linalg_solve_triangular aten.linalg_lstsq "
        "aten.linalg_pinv aten.pinverse aten.linalg_matrix_power aten.matrix_power "
        "aten.linalg_matrix_rank aten.linalg_cond aten.linalg_ldl_factor "
        "aten.linalg_ldl_factor_ex aten.linalg_ldl_solve",
    ),
    op_group(
        "data", CLEAR,
        "moves or selects data without arithmetic: follows its neighbours' precision",
        "aten.view aten.reshape aten._unsafe_view aten.permute aten.transpose aten.t "
        "aten.expand aten.expand_as aten.squeeze aten.unsqueeze aten.flatten aten.unflatten "
        "aten.contiguous aten.clone aten.slice aten.select aten.narrow aten.split "
        "aten.split_with_sizes aten.chunk aten.unbind aten.cat aten.concat aten.stack "
        "aten.gather aten.index aten.index_select aten.embedding aten.pad "
        "aten.constant_pad_nd aten.flip aten.roll aten.repeat aten.tile aten.detach "
        "aten.alias aten.movedim aten.swapaxes aten.pixel_shuffle aten.pixel_unshuffle "
        "aten.upsample_nearest1d aten.upsample_nearest2d aten.upsample_nearest3d "
        "aten.zeros_like aten.ones_like aten.empty_like aten.full_like aten.new_zeros "
        "aten.new_ones aten.new_empty aten.new_full aten.masked_fill aten.where "
        "aten.relu aten.max_pool1d aten.max_pool2d aten.max_pool3d "
        "aten.max_pool2d_with_indices aten.max_pool3d_with_indices aten.adaptive_max_pool1d "
        "aten.adaptive_max_pool2d aten.adaptive_max_pool3d aten.maximum aten.minimum "
        "aten.max aten.min aten.amax aten.amin aten.lift_fresh_copy getitem",
    ),
    op_group(
        SELECTION, CLEAR, SELECTION_REASON,
        "aten.topk aten.sort aten.argsort aten.msort aten.argmax aten.argmin aten.kthvalue "
        "aten.mode",
    ),
)


FX_TABLE = OpTable(FX_GROUPS)


def make_policy(
    level: str,
    *,
    keep_norm_fp32: bool | None = None,
    allow_ops: Iterable[str] = (),
    deny_ops: Iterable[str] = (),
    module_rules: Iterable[tuple[str, str, str]] = (),
) -> LevelPolicy:
    """The policy of one compile over :data:`FX_TABLE`: ``passes.policy.make_policy``
    with the FX op table (arguments and errors as there).

    Example:
        >>> make_policy("O2").op_info("aten.softmax.int").cls
        'deny'
    """
    return make_dialect_policy(level, table=FX_TABLE, keep_norm_fp32=keep_norm_fp32,
                               allow_ops=allow_ops, deny_ops=deny_ops,
                               module_rules=module_rules)


# Inputs an op must receive in their original dtype whatever the op's precision: running
# statistics are updated in place (a cast copy would lose the update), and mixed-precision
# batch norm kernels take fp32 affine parameters with low-precision activations.
FX_FIXED_SLOTS: dict[str, tuple[int, ...]] = {
    "aten.batch_norm": (1, 2, 3, 4),
    "aten.native_batch_norm": (1, 2, 3, 4),
    "aten._native_batch_norm_legit": (1, 2, 3, 4),
    "aten._native_batch_norm_legit_functional": (1, 2, 3, 4),
    "aten._native_batch_norm_legit_no_training": (1, 2, 3, 4),
    "aten.cudnn_batch_norm": (1, 2, 3, 4),
    "aten.instance_norm": (3, 4),
}


def fixed_slots(key: str, table: Mapping[str, tuple[int, ...]] = FX_FIXED_SLOTS) -> tuple:
    """Argument positions of ``key`` that keep their original dtype.

    Example:
        >>> fixed_slots("aten.batch_norm.default")
        (1, 2, 3, 4)
    """
    for candidate in key_candidates(key):
        if candidate in table:
            return table[candidate]
    return ()


__all__ = ["FX_FIXED_SLOTS", "FX_GROUPS", "FX_TABLE", "fixed_slots", "make_policy"]
