"""Dropout on the CPU with a faster draw of its mask.

aten's CPU dropout draws its mask with ``bernoulli_``, slower than
``random_`` draws integers (docs/performance.md#dropout-draw). The
mask here is drawn as 31-bit uniform integers from the same default generator
(``random_``) kept where they fall below ``(1 - p) * 2**31`` rounded: the same
keep probability to 2**-31, reproducible under ``torch.manual_seed`` as aten's, but not
aten's positions. Everything else is aten's ``dropout``: the kept values are multiplied by
``1 / (1 - p)`` computed in the input's dtype, and the product saves that noise for
backward, as aten's does.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def keep_mask(shape: tuple, keep: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Booleans of ``shape``, each true with probability ``keep`` (to 2**-31), drawn from
    the default generator of ``device``."""
    draws = torch.empty(shape, dtype=torch.int32, device=device).random_()  # [0, 2**31)
    return draws <= round(keep * 2 ** 31) - 1  # < 2**31 itself would wrap in int32


def scaled(mask: torch.Tensor, p: float, dtype: torch.dtype) -> torch.Tensor:
    """aten's dropout noise from a keep ``mask``: ``1 / (1 - p)`` where kept, else 0,
    computed in ``dtype`` (in a 16-bit dtype the scale is rounded, as aten's is)."""
    return mask.to(dtype).div_(1 - p)


def amp_dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    """``aten.dropout(input, p, train)``, its mask drawn by :func:`keep_mask` for a dense
    floating-point CPU tensor in training with ``0 < p < 1``; aten's otherwise."""
    if not (train and 0 < p < 1 and input.device.type == "cpu"
            and input.is_floating_point() and input.layout == torch.strided):
        return aten.dropout.default(input, p, train)
    return input * scaled(keep_mask(input.shape, 1 - p), p, input.dtype)
