"""Runtime routing: ops the runtime carries out its own way, called from the rewritten graph.

One pass per module:

- ``weight_casts``: :func:`route_weight_casts`, parameter casts call the runtime's cast (in
  inference a working copy refreshed only when the fp32 master weight changes), at their
  first use.
- ``linears``: :func:`route_linears`, a linear casts its own weight and converts its weight
  gradient.
- ``embeddings``: :func:`route_embeddings`, a lookup on a parameter table picks where its
  gradient goes.
- ``attention``: :func:`route_attention`, attention calls the runtime's implementation,
  which picks the kernel for the shapes it meets.
- ``dropouts``: :func:`route_dropouts`, dropout calls the runtime's, which draws its mask
  faster.
- ``fp8_products``: :func:`route_fp8_products`, the matrix products an FP8 recipe chooses
  call the runtime's FP8 product (the rest keep the level's 16-bit dtype).
- ``output_casts``: :func:`route_output_casts`, the casts of the outputs back to their dtype
  call the runtime's, which may write into a buffer it keeps.

What several share: ``parameter_uses`` (how often a graph reads each parameter: tied
weights are routed with ``shared=True``) and ``low_precision`` (the ops painted low pointed
at a runtime callable, for attention and dropout).

Each replaces matching nodes by a caller-supplied callable; the numbers are the runtime's
to keep (the cast still happens, inside the callable, and stays counted). The modules
import one another only by their own paths, never this ``__init__``.
"""

from __future__ import annotations

from passes.fx.routing.attention import route_attention
from passes.fx.routing.dropouts import route_dropouts
from passes.fx.routing.embeddings import route_embeddings
from passes.fx.routing.fp8_products import route_fp8_products
from passes.fx.routing.linears import route_linears
from passes.fx.routing.output_casts import route_output_casts
from passes.fx.routing.weight_casts import route_weight_casts

__all__ = ["route_attention", "route_dropouts", "route_embeddings", "route_fp8_products",
           "route_linears", "route_output_casts", "route_weight_casts"]
