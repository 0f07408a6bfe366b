"""What collectives move: :class:`CollectiveBytes` counts, per kind and dtype, the bytes
this rank's calls of ``torch.distributed``'s collectives carry, as FSDP2, DDP's comm hooks
and user code call them from Python."""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

# torch.distributed's functions by what they do; the names differ between torch versions.
KINDS = {
    "all_gather": ("all_gather_single", "all_gather_into_tensor", "_all_gather_base"),
    "reduce_scatter": ("reduce_scatter_single", "reduce_scatter_tensor",
                       "_reduce_scatter_base"),
    "all_reduce": ("all_reduce",),
}


class CollectiveBytes:
    """Count collective bytes while active: ``counts[(kind, dtype)]`` in bytes.

    An all-gather counts the tensor it gathers into (the whole parameter, as every rank
    receives it), a reduce-scatter the tensor it reduces (every rank's whole gradient), an
    all-reduce its tensor. Collectives issued from C++ (DDP's default bucket all-reduce) are
    not seen.

    Example:
        >>> with CollectiveBytes() as traffic:
        ...     loss = model(x).sum(); loss.backward()
        >>> traffic.total("all_gather") / 2**20  # MiB
    """

    def __init__(self) -> None:
        self.counts: Counter[tuple[str, torch.dtype]] = Counter()
        self._saved: list[tuple[str, Any]] = []

    def __enter__(self) -> CollectiveBytes:
        for kind, names in KINDS.items():
            for name in names:
                original = getattr(dist, name, None)
                if original is not None:
                    self._saved.append((name, original))
                    setattr(dist, name, self._counting(kind, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in reversed(self._saved):
            setattr(dist, name, original)
        self._saved.clear()

    def total(self, kind: str, dtype: torch.dtype | None = None) -> int:
        """Bytes of ``kind`` ("all_gather", "reduce_scatter", "all_reduce"), of one dtype or
        all."""
        return sum(n for (k, d), n in self.counts.items()
                   if k == kind and (dtype is None or d == dtype))

    def by_dtype(self, kind: str) -> dict[str, int]:
        """``{"bf16": bytes, ...}`` for one kind."""
        return {str(d).removeprefix("torch."): n for (k, d), n in sorted(
            self.counts.items(), key=str) if k == kind}

    def _counting(self, kind: str, original: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            tensor = _counted_tensor(kind, args, kwargs)
            if isinstance(tensor, torch.Tensor):
                self.counts[(kind, tensor.dtype)] += tensor.numel() * tensor.element_size()
            return original(*args, **kwargs)

        return call


def _counted_tensor(kind: str, args: tuple, kwargs: dict) -> Any:
    if kind == "all_gather":  # (output, input, ...): the gathered output
        return args[0] if args else kwargs.get("output", kwargs.get("output_tensor"))
    if kind == "reduce_scatter":  # (output, input, ...): the reduced input
        return args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
    return args[0] if args else kwargs.get("tensor")
