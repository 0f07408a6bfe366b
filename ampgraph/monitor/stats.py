"""On-device statistics of tensor lists for ``NumericsMonitor``, and their host-side merge.

Large tensors are measured one by one with a handful of full-tensor passes (``abs``, the
shifted data ``x - x[0]`` for its sum and 2-norm, three comparisons counted with
``count_nonzero``, ``amax``/``amin``); small tensors (biases, norm
weights) are concatenated into chunks and reduced per tensor with ``torch.segment_reduce``
(``unsafe=True``: no host sync), so they cost a few dozen kernels per chunk, not per tensor.
Either way the result is one ``(tensors, len(COLUMNS))`` fp32 tensor on the device, fetched
by the monitor with a single ``.cpu()``; :func:`merge` then combines the tensors of a layer in
float64 (pooled mean and variance).

Underflow and overflow are tested against thresholds divided by the loss scale
(``|x| < tiny / scale`` rather than ``|x * scale| < tiny``), which is exact for power-of-two
scales and saves a pass.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["CHUNK", "COLUMNS", "SMALL", "STAT_FIELDS", "Limits", "Plan", "limits", "merge",
           "tensor_stats"]

# Per-tensor columns, in order: a shift (one of the tensor's values, or its mean), the sum and
# the sum of squares of ``x - shift`` (shifted data keeps the variance free of cancellation),
# exact zeros, non-zero values below the low dtype's smallest normal at the loss scale,
# values that are (or at the loss scale would become) inf/NaN, largest and smallest non-zero
# magnitude.
COLUMNS = ("shift", "sum", "sumsq", "zeros", "under", "over", "max_abs", "min_abs")
# Fields of one merged statistics dict (what numerics.jsonl holds per layer and kind).
STAT_FIELDS = ("numel", "norm", "min_abs", "max_abs", "mean", "std", "zero_frac",
               "underflow_rate", "overflow_count")
SMALL = 1 << 16  # tensors below this many elements are batched (kernel launches dominate)
CHUNK = 1 << 20  # elements of small tensors reduced together (bounds the temporaries)


@dataclass(frozen=True)
class Limits:
    """The low dtype's range: ``tiny`` is its smallest normal, ``max`` its largest finite."""

    name: str
    tiny: float
    max: float


def limits(dtype: torch.dtype) -> Limits:
    """The range :func:`tensor_stats` tests against for ``dtype`` (fp16 or bf16).

    Example:
        >>> limits(torch.float16).tiny == 2**-14
        True
    """
    info = torch.finfo(dtype)
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    return Limits(name, float(info.tiny), float(info.max))


class Plan:
    """Which tensors (by size) are measured alone and which are batched (built once, cached).

    Attributes:
        large: indices of the tensors measured one by one.
        chunks: indices of the small tensors reduced together, per chunk.
        order: the tensor index of each output row.
    """

    def __init__(self, numels: Sequence[int], device: torch.device, small: int = SMALL,
                 chunk: int = CHUNK) -> None:
        self.large = [i for i, n in enumerate(numels) if n >= small]
        self.chunks: list[list[int]] = []
        size = chunk
        for i, n in enumerate(numels):
            if n < small:
                if size + n > chunk:
                    self.chunks.append([])
                    size = 0
                self.chunks[-1].append(i)
                size += n
        self.order = self.large + [i for c in self.chunks for i in c]
        self.totals = [sum(numels[i] for i in c) for c in self.chunks]
        self.lengths = [torch.tensor([numels[i] for i in c], dtype=torch.int64, device=device)
                        for c in self.chunks]


def tensor_stats(
    tensors: Sequence[torch.Tensor], plan: Plan, scale: torch.Tensor | float, lim: Limits
) -> torch.Tensor:
    """``(len(tensors), len(COLUMNS))`` fp32 statistics on the tensors' device (no sync).

    Rows follow ``plan.order``. ``scale`` is the loss scale the values were divided by (1.0
    for weights, activations and optimizer state): a non-zero value underflows when
    ``|x| * scale < lim.tiny`` and overflows when it is not finite or ``|x| * scale > lim.max``.

    Example:
        >>> t = [torch.tensor([0.0, 1e-6, 1.0])]
        >>> tensor_stats(t, Plan([3], t[0].device), 1.0, limits(torch.float16))[0, 4].item()
        1.0
    """
    lo, hi = lim.tiny / scale, lim.max / scale  # 0-dim device tensors when scale is one
    rows = []
    with torch.no_grad():
        for i in plan.large:
            rows.append(_one(tensors[i].detach().reshape(-1).float(), lo, hi).unsqueeze(0))
        for indices, lengths, total in zip(plan.chunks, plan.lengths, plan.totals):
            flat = torch.cat([tensors[i].detach().reshape(-1).float() for i in indices])
            rows.append(_segments(flat, lengths, total, lo, hi))
    return rows[0] if len(rows) == 1 else torch.cat(rows)


def _one(x: torch.Tensor, lo: torch.Tensor | float, hi: torch.Tensor | float) -> torch.Tensor:
    a = x.abs()
    shift = x[0]  # a sample of the data: |mean - shift| is of the order of the std
    d = x - shift
    zero = a == 0
    zeros = torch.count_nonzero(zero)  # count_nonzero: exact, no float copy of a mask
    under = torch.count_nonzero(a < lo) - zeros  # zeros are below lo too
    over = x.numel() - torch.count_nonzero(a <= hi)  # inf and NaN fail <=
    min_abs = torch.where(zero, math.inf, a).amin()
    return torch.stack((shift, d.sum(), torch.linalg.vector_norm(d).square(), zeros.float(),
                        under.float(), over.float(), a.amax(), min_abs))


def _segments(flat: torch.Tensor, lengths: torch.Tensor, total: int,
              lo: torch.Tensor | float, hi: torch.Tensor | float) -> torch.Tensor:
    def seg(values: torch.Tensor, how: str) -> torch.Tensor:
        return torch.segment_reduce(values, how, lengths=lengths, unsafe=True)

    a = flat.abs()
    mean = seg(flat, "sum") / lengths.to(torch.float32)
    centred = flat - torch.repeat_interleave(mean, lengths, output_size=total)
    sumsq = seg(centred * centred, "sum")
    zero = a == 0
    zeros = seg(zero.float(), "sum")
    under = seg((a < lo).float(), "sum") - zeros
    over = seg((a <= hi).logical_not_().float(), "sum")
    max_abs = seg(a, "max")
    min_abs = seg(a.masked_fill_(zero, math.inf), "min")
    return torch.stack((mean, torch.zeros_like(mean), sumsq, zeros, under, over, max_abs,
                        min_abs), dim=1)


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def merge(rows: Sequence[Sequence[float]], numels: Sequence[int]) -> dict[str, float | None]:
    """Combine the rows (host floats, :data:`COLUMNS` order) of one layer's tensors.

    ``mean``/``std`` (population)/``norm`` (2-norm) pool all values and are None when a
    value is inf/NaN (see ``overflow_count``); ``min_abs`` is the smallest non-zero
    magnitude (0.0 when all are zero); ``underflow_rate`` divides by the non-zero values;
    ``overflow_count`` counts values that are (or at the loss scale would be) inf/NaN.

    Example:
        >>> merge([[1.0, 1.0, 1.0, 0, 0, 0, 2.0, 1.0]], [2])["norm"] == 5 ** 0.5
        True
    """
    n = sum(numels)
    means, m2s = [], []
    for (shift, total, sumsq, *_), k in zip(rows, numels):
        means.append(shift + total / k)
        m2s.append(max(sumsq - total * total / k, 0.0))
    mean = sum(m * k for m, k in zip(means, numels)) / n if n else 0.0
    m2 = sum(v + k * (m - mean) ** 2 for m, v, k in zip(means, m2s, numels))
    zeros = sum(r[3] for r in rows)
    nonzero = n - zeros
    mins = [r[7] for r in rows if math.isfinite(r[7])]
    ok = math.isfinite(mean) and math.isfinite(m2)
    return {
        "numel": int(n),
        "norm": math.sqrt(m2 + n * mean * mean) if ok else None,
        "min_abs": min(mins) if mins else (0.0 if zeros == n else None),
        "max_abs": _finite(max((r[6] for r in rows), default=0.0)),
        "mean": mean if ok else None,
        "std": math.sqrt(m2 / n) if ok and n else None,
        "zero_frac": zeros / n if n else 0.0,
        "underflow_rate": max(0.0, sum(r[4] for r in rows)) / nonzero if nonzero > 0 else 0.0,
        "overflow_count": int(round(sum(r[5] for r in rows))),
    }
