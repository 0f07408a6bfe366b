"""Runtime: what a compiled module's graphs call at run time on one kind of device.

``AmpModule`` builds one runtime per compiled module, named by the resolved configuration
(the model's device, or the ``runtime=`` the user chose), and hands its
:meth:`Runtime.ops` to the passes. The passes and the rest of the package never ask
which device they run on: a runtime's choices live in its folder (``runtime/cpu/``,
``runtime/cuda/``), and adding a device is adding a folder and a line in
``ampgraph/runtime/__init__.py``.

A graph handed to ``torch.compile`` (``compile(..., backend=...)``) calls none of the
runtime's Python inside it; :meth:`Runtime.compiled_edges` says what the runtime does at
its edges instead, outside the compiled code (``compiled.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ampgraph.runtime.fp8 import Float8Products
from passes.fx.runtime_ops import RuntimeOps


@dataclass(frozen=True)
class CompiledEdges:
    """What a runtime does outside a compiled graph's code (``compiled.py``); a
    field left None stays inside the compiled graph.

    Attributes:
        weight_copy: ``(param, dtype, memory_format)`` -> the parameter's low-precision
            copy, kept until the master changes, for calls without gradients (the graph
            takes it as an input instead of casting every weight on every call).
        output_cast: ``(x, dtype, slot)`` -> ``x.to(dtype)``, differentiable: the graph's
            output ``slot`` cast back after the compiled code (into a kept buffer where a
            fresh one would fault its pages in).
        output_linear: ``(x, w, b, dtype, slot)`` -> ``linear(x, w, b).to(dtype)`` for an
            output that is a linear's product cast back (a language model's logits), ``w``
            and ``b`` already low, for calls without gradients (with ``weight_copy``).

    Example:
        >>> CompiledEdges().weight_copy is None
        True
    """

    weight_copy: Callable[..., Any] | None = None
    output_cast: Callable[..., Any] | None = None
    output_linear: Callable[..., Any] | None = None


class Runtime:
    """The base: every op aten's own. Subclasses override what they run their way.

    Example:
        >>> Runtime().ops(backend=None).routes_weights
        False
    """

    name: ClassVar[str] = "aten"

    def ops(self, backend: str | None) -> RuntimeOps:
        """The ops the passes route to this runtime; with a ``torch.compile`` backend only
        those the compiler can trace."""
        return RuntimeOps(fp8_linear=self.fp8_linear(backend))

    def fp8_linear(self, backend: str | None) -> Any:
        """The FP8 product the graphs call (every runtime's): eagerly, each weight's FP8
        copy made once per step and kept; under ``torch.compile``, all of it inline, for
        the compiler to fuse."""
        key = "_amp_fp8" if backend is None else "_amp_fp8_compiled"
        products = self.__dict__.get(key)
        if products is None:
            products = self.__dict__[key] = Float8Products(cache_weights=backend is None)
        return products.linear

    def clear_fp8(self) -> None:
        """Drop the FP8 copies of the weights (made again at their next use)."""
        products = self.__dict__.get("_amp_fp8")
        if products is not None:
            products.clear()

    def compiled_edges(self) -> CompiledEdges:
        """What this runtime does around a graph handed to ``torch.compile``; the base:
        nothing (the compiled graph does it all)."""
        return CompiledEdges()

    def working_copies(self) -> list[torch.Tensor]:
        """Low-precision copies of the weights kept between training steps."""
        return []

    def nbytes(self) -> int:
        """Bytes held between calls (working copies, kept buffers)."""
        return 0

    def clear(self) -> None:
        """Drop what is kept between calls (after ``p.data`` edits)."""
        self.clear_fp8()

    def invalidate(self) -> None:
        """Write every kept working copy again at its next use, keeping the copies (what a
        CUDA graph capture must record); nothing to do where no copy is kept."""
