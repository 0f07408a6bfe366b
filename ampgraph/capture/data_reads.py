"""``tensor.data`` read as ``tensor.detach()`` while torch.export traces a model.

A forward that writes a parameter through ``.data`` (Gemma 3n's AltUp clamps its
coefficients in train mode: ``self.prediction_coefs.weight.data.clamp_(-c, c)``) cannot be
exported as it is: ``.data`` of a traced (fake) tensor is a new fake tensor the tracer does
not know, and torch.export fails with "We found a fake tensor in the exported program
constant's list". Read as ``detach()``, the same alias without a gradient, it is traced as
``aten.detach`` of the parameter and the write as the in-place op on it, in the graph's
order: the graph writes the parameter where eager did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensor

_DATA = torch._C.TensorBase.data  # the getset descriptor torch.Tensor inherits


def _data(tensor: torch.Tensor) -> torch.Tensor:
    if isinstance(tensor, FakeTensor):  # a value export traces
        return tensor.detach()
    return _DATA.__get__(tensor)


@contextlib.contextmanager
def traced_data_reads() -> Iterator[None]:
    """Within the block, ``t.data`` of a tensor export traces is ``t.detach()`` (any other
    tensor's ``.data`` and every ``.data = ...`` are torch's own).

    Example:
        >>> with traced_data_reads():
        ...     ep = torch.export.export(model, (x,), strict=False)
    """
    torch.Tensor.data = property(_data, _DATA.__set__, doc=_DATA.__doc__)
    try:
        yield
    finally:
        del torch.Tensor.data


__all__ = ["traced_data_reads"]
