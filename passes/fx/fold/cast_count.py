"""Cast folding after cast insertion, duplicate and dead ops, and the count of the casts a
graph holds."""

from __future__ import annotations

import torch
from torch import fx

from passes._infra import PassResult
from passes.fx._torch_internals import OpOverload, op_schema
from passes.fx.dtypes import CAST, _widening, dtype_of, is_amp_cast
from passes.fx.graph import is_view


def count_casts(gm: fx.GraphModule) -> int:
    """The casts the passes inserted in ``gm`` (``meta["amp_cast"]``).

    Example:
        >>> count_casts(gm)
        7
    """
    return sum(1 for n in gm.graph.nodes if n.meta.get("amp_cast"))
