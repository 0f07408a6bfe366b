"""Dropout on the CPU with a faster draw of its mask.

aten's CPU dropout draws its mask with ``bernoulli_``, slower than ``random_`` draws
integers (docs/performance.md#dropout-draw). The mask here comes from 31-bit uniform
integers from the same default generator (``random_``), two elements from each (its 16 low
and 15 high bits, kept where they fall below ``(1 - p)`` times ``2**16`` or ``2**15``,
rounded): the same keep probability to 2**-16 (to 2**-31, one element a draw, where ``p``
or ``1 - p`` is below ``2**-8``), reproducible under ``torch.manual_seed`` as aten's, but
not aten's positions. Everything else is aten's ``dropout``: the kept values are
multiplied by ``1 / (1 - p)`` computed in the input's dtype, and the product saves that
noise for backward, as aten's does.
"""

from __future__ import annotations

import math
import sys

import torch

aten = torch.ops.aten


def keep_mask(shape: tuple, keep: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """Booleans of ``shape``, each true with probability ``keep``, drawn from the default
    generator of ``device``: two elements from each 31-bit draw (its low 16 bits and its
    high 15, to 2**-16) where ``keep`` and ``1 - keep`` are at least ``2**-8`` (a
    relative error in either of at most 2**-8), else one (to 2**-31)."""
    n = math.prod(shape)
    if not HALVES_FROM <= keep <= 1 - HALVES_FROM:
        draws = torch.empty(shape, dtype=torch.int32, device=device).random_()  # [0, 2**31)
        return draws <= round(keep * 2 ** 31) - 1  # < 2**31 itself would wrap in int32
    draws = torch.empty((n + 1) // 2, dtype=torch.int32, device=device).random_()
    halves = draws.view(torch.int16).view(-1, 2)  # the low half signed: [-2**15, 2**15)
    low = round(keep * 2 ** 16) - 2 ** 15  # both within int16 for keep in that range
    high = round(keep * 2 ** 15)
    limits = (low, high) if sys.byteorder == "little" else (high, low)
    mask = halves < torch.tensor(limits, dtype=torch.int16, device=device)
    return mask.view(-1)[:n].view(shape)


# keep probabilities from which two elements come from one draw (see keep_mask); halves the
# draws, ~2 ns an element (docs/performance.md#dropout-draw)
HALVES_FROM = 2 ** -8


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
