"""State forward keeps for its own use, which is no side effect of the graph
(``capture/side_effects.py`` finds the changes; these are the ones it lets pass):

- :func:`own_caches`: a cache of the model's own parameters and buffers (``nn.LSTM``'s
  ``_flat_weights``);
- :func:`parameter_caches`: tensors cached in a list, dict or set that the trace computed
  without the inputs (LeViT's eval-mode ``attention_bias_cache``);
- :func:`scratch_state`: attributes forward sets before it reads them (funnel's
  ``attention_structure.seq_len`` and ``pooling_mult``).

docs/faithfulness.md says what each leaves in the user's objects.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ampgraph.capture.side_effects import CONTAINERS, Effect, StateSnapshot, holds_traced
from ampgraph.capture.watch import DELETED, MODULE_STATE


def own_caches(effects: list[Effect], own: set[int], snap: StateSnapshot) -> list[Effect]:
    """``effects`` less the caches of the model's own tensors: a change whose new value
    holds only the fake tensors that stood in for the model's parameters and buffers
    (``nn.LSTM``'s ``_flat_weights``, rebuilt from its parameters on every call) is put
    back at once and is no side effect."""
    kept, caches = [], []
    for e in effects:
        (caches if holds_traced(e.value) and not holds_traced(e.value, own) else kept).append(e)
    if caches:
        snap.restore(caches)
    return kept


def parameter_caches(model: nn.Module, inputs: Any) -> set[int]:
    """Within a trace, at the end of forward: the ids of the fake tensors held in the lists,
    dicts and sets of the model's modules that the trace computed without the inputs: from
    parameters, buffers and constants only. (A tensor attribute assigned in forward stays a
    side effect whatever it is computed from: the user may read it.)

    A forward that caches such a tensor (timm's LeViT, EfficientFormerV2, TinyViT keep
    ``attention_biases[:, idxs]`` in an ``attention_bias_cache`` dict in eval mode) stores a
    value the graph computes again on every call from the same parameters: the cache is put
    back as it was (:func:`own_caches`), and no module leaves the graph for it. A tensor
    computed from an input (a log, a recurrent state) stays a side effect.

    Example:
        >>> watch.own.update(parameter_caches(model, (args, kwargs)))  # doctest: +SKIP
    """
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot

    mode = get_proxy_mode()
    if mode is None:
        return set()

    def node(t: torch.Tensor) -> Any:
        proxy = get_proxy_slot(t, mode.tracer, None)
        return getattr(getattr(proxy, "proxy", None), "node", None)

    sources = {n for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)
               for n in (node(t),) if n is not None}
    if not sources:
        return set()
    found: dict[int, torch.Tensor] = {}
    for m in model.modules():
        for k, v in m.__dict__.items():
            if k not in MODULE_STATE and isinstance(v, CONTAINERS):  # caches, not attributes
                _fakes(v, found, 1)
    own = set()
    for i, t in found.items():
        n = node(t)
        if n is not None and not _reaches(n, sources):
            own.add(i)
    return own


def _fakes(value: Any, found: dict[int, torch.Tensor], depth: int = 0) -> None:
    if isinstance(value, FakeTensor):
        found[id(value)] = value
    elif depth < 3 and isinstance(value, dict):
        for v in list(value.values())[:64]:
            _fakes(v, found, depth + 1)
    elif depth < 3 and isinstance(value, (list, tuple, set)):
        for v in list(value)[:64]:
            _fakes(v, found, depth + 1)


def _reaches(node: Any, sources: set) -> bool:
    """Whether ``node`` is computed from one of ``sources`` (graph ancestors)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n in sources:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def scratch_state(effects: list[Effect], scratch: set[tuple[int, str]],
                  written_first: set[tuple[int, str]], snap: StateSnapshot) -> list[Effect]:
    """``effects`` less the writes of scratch state, which forward sets on every call
    before it reads it: what the attribute held before the call never reaches the graph,
    so no module leaves the graph for it and no second export is needed.

    - an attribute forward wrote before reading it, then read back (``Watch.scratch``:
      funnel's ``pooling_mult``): a plain value is left as eager leaves it, a traced one is
      put back as it was;
    - an attribute forward wrote before reading it and never read, set to a size of the
      inputs (funnel's ``attention_structure.seq_len = inputs_embeds.size(1)``, a symbolic
      int with a hint): put back as it was (it keeps its value from before the call;
      docs/faithfulness.md says so). Any other value forward writes and never reads itself
      (``self.last = loss.item()``, a tensor) is for the user: it stays a side effect."""
    kept, traced = [], []
    for e in effects:
        key = (id(e.owners[0].__dict__), e.key[2]) if (
            e.key[:1] == ("attr",) and len(e.owners) == 1) else None
        if key is None or not (key in scratch or key in written_first and _a_size(e.value)):
            kept.append(e)
        elif e.leak:
            traced.append(e)
        elif e.value is DELETED:
            e.owners[0].__dict__.pop(e.key[2], None)
        else:
            e.owners[0].__dict__[e.key[2]] = e.value
    if traced:
        snap.restore(traced)
    return kept


def _a_size(value: Any) -> bool:
    """A symbolic int the trace knows a value of: a size of the inputs (not ``.item()``)."""
    from torch.fx.experimental import symbolic_shapes

    if not isinstance(value, torch.SymInt):
        return False  # torch 2.13 names it has_guarding_hint, 2.11 has_hint
    check = getattr(symbolic_shapes, "has_guarding_hint", None) or getattr(
        symbolic_shapes, "has_hint", None)
    return bool(check(value)) if check else getattr(value.node, "hint", None) is not None


__all__ = ["own_caches", "parameter_caches", "scratch_state"]
