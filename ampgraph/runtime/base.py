"""Runtime: what a compiled module's graphs call at run time on one kind of device.

``AmpModule`` builds one runtime per compiled module, named by the resolved configuration
(the model's device, or the ``runtime=`` the user chose), and hands its
:meth:`Runtime.ops` to the passes. The passes and the rest of the package never ask
which device they run on: a runtime's choices live in its folder (``runtime/cpu/``,
``runtime/cuda/``), and adding a device is adding a folder and a line in
``ampgraph/runtime/__init__.py``.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from passes.fx.runtime_ops import RuntimeOps


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
        return RuntimeOps()

    def working_copies(self) -> list[torch.Tensor]:
        """Low-precision copies of the weights kept between training steps."""
        return []

    def nbytes(self) -> int:
        """Bytes held between calls (working copies, kept buffers)."""
        return 0

    def clear(self) -> None:
        """Drop what is kept between calls (after ``p.data`` edits)."""

    def invalidate(self) -> None:
        """Write every kept working copy again at its next use, keeping the copies (what a
        CUDA graph capture must record); nothing to do where no copy is kept."""
