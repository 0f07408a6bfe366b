"""The activations a linear of the CPU runtime applies to its own output.

``passes.fx.routing.linears`` hands a linear the activation that is its output's only
reader (``linear(..., activation="gelu")``). Packed inference weights apply it in oneDNN's
epilogue (``packed.EPILOGUES``): no pass of its own over the output, and computed on the
fp32 accumulator before the one rounding; every other call applies it as aten's op after
the product, as the graph did.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

ACTIVATIONS = {
    "relu": torch.relu,
    "gelu": F.gelu,
    "gelu_tanh": functools.partial(F.gelu, approximate="tanh"),
    "silu": F.silu,
}


def activate(out: torch.Tensor, activation: str | None) -> torch.Tensor:
    """``out`` through the named activation (a key of :data:`ACTIVATIONS`), or as it is.

    Example:
        >>> activate(torch.tensor([-1.0, 2.0]), "relu")
        tensor([0., 2.])
    """
    return out if activation is None else ACTIVATIONS[activation](out)
