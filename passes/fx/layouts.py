"""Layouts: a low-precision linear keeps the 2-D matrix product its input allows.

``aten.linear`` on an input of three or more dimensions goes through ``matmul``. When the
leading dimensions cannot be folded into one by a view (a transposed, sequence-first
activation such as torchvision ViT's attention in-projection) and no operand requires grad
(inference), matmul expands the weight over the leading dimension and calls ``bmm``. In
fp32 that batched product reads the expanded weight in place; the bf16 CPU kernel copies it
once per leading index (docs/performance.md#contiguous-linear-inputs; torch.autocast's
weight cast happens to take the folding path). A contiguous input folds
by a view into one ``mm``/``addmm``: the cost is one activation-sized copy, the same copy
matmul makes when it folds.

:func:`contiguous_linear_inputs` makes that copy explicit, with ``aten.contiguous``, which
returns its input unchanged when it already is contiguous, so an input whose layout is only
known at run time (symbolic strides) costs nothing when the guess was wrong.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from passes._infra import PassResult, visiting
from passes.fx.dtypes import dtype_of

aten = torch.ops.aten
LINEAR = aten.linear.default
CONTIGUOUS = aten.contiguous.default


def contiguous_linear_inputs(gm: fx.GraphModule, low: torch.dtype) -> PassResult:
    """Insert ``aten.contiguous`` before every ``low`` linear whose 3+-D input may not fold.

    Example:
        >>> contiguous_linear_inputs(gm, torch.bfloat16).modified
        True
    """
    graph = gm.graph
    modified = False
    for node in visiting(graph.find_nodes(op="call_function", target=LINEAR)):
        x = node.args[0]
        if not isinstance(x, fx.Node) or dtype_of(x) != low or x.target is CONTIGUOUS:
            continue
        val = x.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 3 or foldable(val):
            continue
        with graph.inserting_before(node):
            copy = graph.call_function(CONTIGUOUS, (x,))
        copy.meta.update({k: v for k, v in x.meta.items() if k in _KEPT_META})
        copy.meta["val"] = _contiguous_val(val)
        copy.meta["amp_layout"] = "contiguous linear input (folds into one matrix product)"
        node.replace_input_with(x, copy)
        modified = True
    return PassResult(gm, modified)


def foldable(t: Any) -> bool:
    """Whether ``t.view(-1, t.size(-1))`` needs no copy, as far as is known statically."""
    sizes, strides = t.shape, t.stride()
    return all(statically_known_true(strides[i] == strides[i + 1] * sizes[i + 1])
               for i in range(t.dim() - 2))


_KEPT_META = ("amp_precision", "amp_reason", "amp_dtype", "nn_module_stack", "stack_trace")


def _contiguous_val(val: torch.Tensor) -> torch.Tensor:
    fake_mode = getattr(val, "fake_mode", None)
    if fake_mode is None:
        return val.contiguous()
    with fake_mode:
        return val.contiguous()
