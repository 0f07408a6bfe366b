"""ampgraph: graph-level automatic mixed precision (MindSpore-style O0-O3) for PyTorch.

Example:
    >>> import ampgraph
    >>> net = ampgraph.compile(model, amp_level="O2")        # bf16 on CPU / sm_80+
    >>> print(ampgraph.explain(net, example_input))           # what runs in which precision
"""

from __future__ import annotations

from ampgraph.api import compile
from ampgraph.config import AmpConfig
from ampgraph.module import AmpModule
from ampgraph.report import PrecisionReport, explain

__version__ = "0.1.0"

__all__ = [
    "AmpConfig",
    "AmpModule",
    "PrecisionReport",
    "compile",
    "explain",
]
