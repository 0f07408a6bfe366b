"""Which dimensions of a capture's inputs torch.export is asked to keep dynamic.

Every dimension may be dynamic (export specialises what the model fixes), except an image's
past its batch: a symbolic height and width flowing through windowed attention (Swin's
padding to whole windows, window partitions, patch merging) give sympy nested floor
divisions and remainders to simplify at every reshape, and export of a two-stage Swin took
over a minute where a static one takes half a second
(docs/performance.md#compile-time). An image of another size is captured again.

A model whose shape arithmetic goes through tensors (Longformer's
``torch.div(x.size(1), 2 * w, rounding_mode="trunc")`` as a ``view`` size) makes export
read a symbolic size back from a tensor as an unbacked value it cannot guard on
(``8*u1 < 16``); with static sizes the arithmetic is on plain ints. :func:`static_retry`
tells such an error apart from a guard on the data itself.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.export import Dim
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.utils import _pytree as pytree

from ampgraph.capture.structure import BUILTIN_NODE_TYPES

# rank of an image batch a convolution of each kind takes: (N, C, H, W), (N, C, D, H, W)
_CONV_INPUT_RANK = ((nn.Conv2d, 4), (nn.Conv3d, 5))


def image_channels(model: nn.Module) -> frozenset[tuple[int, int]]:
    """(rank, channels) of the image batches ``model``'s convolutions take: ``(4, c)`` for
    each 2-D convolution's ``in_channels``, ``(5, c)`` for each 3-D one's.

    Example:
        >>> sorted(image_channels(nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 8, 3))))
        [(4, 3), (4, 8)]
    """
    return frozenset((rank, m.in_channels) for m in model.modules()
                     for kind, rank in _CONV_INPUT_RANK if isinstance(m, kind))


def is_image(x: Any, images: frozenset[tuple[int, int]]) -> bool:
    """Whether ``x`` is a floating-point batch of images a convolution of the model takes:
    rank and channels (dim 1) among ``images`` (:func:`image_channels`).

    Example:
        >>> is_image(torch.randn(2, 3, 32, 32), frozenset({(4, 3)}))
        True
    """
    return (isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() > 1
            and (x.dim(), x.shape[1]) in images)


def dynamic_spec(inputs: Any, images: frozenset[tuple[int, int]] = frozenset()) -> Any:
    """Every dimension of every tensor input may be dynamic (export specialises as needed),
    but an image's past the batch: an argument of ``(args, kwargs)`` itself (not one inside
    a container) that :func:`is_image` with ``images`` keeps its other sizes static.

    A registered pytree node that is not a built-in container (a HuggingFace cache) gets
    its children's specs in the sequence its flatten returns them in (a tuple or a list),
    which is what torch.export expects for such types. (A ``torch.Size`` input has no spec
    export accepts: :func:`~ampgraph.capture.export.export_module` gives export a tuple
    instead, see :func:`~ampgraph.capture.structure.exportable_inputs`.)

    Example:
        >>> x = torch.randn(2, 3, 32, 32)
        >>> dynamic_spec(((x,), {}), image_channels(nn.Conv2d(3, 8, 3)))
        (({0: DimHint(AUTO)},), {})
    """
    def spec(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {i: Dim.AUTO for i in range(x.dim())}
        if pytree.tree_is_leaf(x):
            return None
        node_type = pytree._get_node_type(x)
        node = pytree.SUPPORTED_NODES[node_type]
        children, context = node.flatten_fn(x)
        specs = [spec(c) for c in children]
        if node_type in BUILTIN_NODE_TYPES:
            return node.unflatten_fn(specs, context)
        # e.g. a cache, a ModelOutput passed back in (encoder_outputs): its children's
        # specs in the sequence its flatten returns them in (a tuple as a tuple)
        return tuple(specs) if type(children) is tuple else specs

    def argument(x: Any) -> Any:
        return {0: Dim.AUTO} if is_image(x, images) else spec(x)

    if not images:
        return spec(inputs)
    args, kwargs = inputs
    return (tuple(argument(a) for a in args), {k: argument(v) for k, v in kwargs.items()})


# the guard torch could not decide, unhinted: with the inputs' size symbols (s0, s27 ...)
_UNHINTED = re.compile(r"\(unhinted: (.*?)\)\.  \(Size-like symbols", re.S)
_SIZE_SYMBOL = re.compile(r"\bs\d+\b")


def static_retry(exc: Exception) -> bool:
    """Whether export, which failed with ``exc`` on dynamic sizes, may succeed on static
    ones: a data-dependent guard whose unhinted condition involves an input size (a size
    that went through a tensor and came back unbacked), not one on data alone
    (``Eq(u0, 0)``: a branch on a count of ``nonzero()`` hits).

    Example:
        >>> static_retry(GuardOnDataDependentSymNode(cond, "... 8*u1 < 16 (unhinted: "
        ...              "8*u1 < s27 + (Mod(8 - (Mod(s27, 8)), 8))).  (Size-like symbols: none)"))
        True
    """
    if not isinstance(exc, GuardOnDataDependentSymNode):
        return False
    found = _UNHINTED.search(str(exc))
    return found is not None and _SIZE_SYMBOL.search(found.group(1)) is not None
