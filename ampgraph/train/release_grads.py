"""``build_train_step(..., release_grads=True)``: each parameter is stepped in backward as
soon as its gradient is complete, and the gradient is freed there.

The gradients of a whole model are never alive together (torchtune's
``optimizer_in_bwd``, LOMO): a gradient lives from its accumulation to its parameter's
update. :class:`ReleasedGradients` registers a post-accumulate-grad hook on every
parameter the optimizer holds; while the step's backward runs (:meth:`stepping`), the hook

1. checks the gradient for inf/NaN into the step's ``found_inf`` (the loss's check is
   already in it), with the fused non-finite check the unscale uses;
2. steps that parameter alone with the user's optimizer (its ``param_groups`` narrowed to
   it for the call, so its hyper-parameters, learning-rate schedules, state and
   ``state_dict`` stay the optimizer's own), or with the 16-bit weights' update rule:
   unless ``found_inf`` is set. A fused optimizer takes ``found_inf`` and skips on the
   device; otherwise the flag is read on the host, once per parameter;
3. sets ``p.grad = None``.

A parameter larger than ``CHUNK`` elements is stepped in flat chunks of that many, each a
view of the parameter, its gradient and its state (the optimizer's state is made by the
optimizer itself, chunk by chunk, on the parameter's first step): an update is elementwise,
so the values are those of one call for the whole parameter, and the temporaries of
torch's default AdamW (``exp_avg_sq.sqrt()`` and the like) are a chunk's size, not the
parameter's. In backward every activation is still alive; a 128256 x 512 head's
temporaries would be 250 MiB each.

It is also the gradient sink (``runtime/grad_sinks.py``) of each
parameter: an op that forms a parameter's whole gradient by blocks (the fused head of an
untied LM head) hands each block to :meth:`ReleasedGradients.take`, stepped at once as a
chunk, so that gradient never exists whole. A gradient for such a parameter arriving after
that from elsewhere is refused with an error, not stepped twice.

What cannot be honoured is refused when the step is built (:func:`check_release`): a
global gradient-norm clip (it needs every gradient first), accumulation over
micro-batches (the gradients would have to live on), a loss-scale manager (fp16's skip on
overflow decides for the whole step after backward; bf16 needs none), a monitor (it reads
the gradients after backward), a distributed network (DDP reduces buckets after the
hooks; FSDP2 shards), CUDA graphs, and optimizers other than SGD, Adam and AdamW (plain,
foreach or fused). Once a gradient is non-finite, the parameters not stepped yet are not
stepped (the ones before it were): the step reports the overflow.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampgraph.runtime.grad_sinks import register_sink, unregister_sink
from ampgraph.train.low_precision_weights import UPDATE_CHUNK

__all__ = ["CHUNK", "ReleasedGradients", "check_release"]

_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)

# Elements of a parameter stepped at once: the 16-bit update's chunk, a multiple of any
# vector width, so that each chunk starts where a whole-parameter call would start a
# vector (fused AdamW computes a tail shorter than a vector in another way)
CHUNK = UPDATE_CHUNK


def check_release(optimizer: torch.optim.Optimizer, *, clip: float | None,
                  accumulation_steps: int, scaled: bool, monitor: bool, distributed: bool,
                  sharded: bool, cuda_graph: bool) -> None:
    """Raise ValueError, naming the fix, for a step that cannot release its gradients.

    Example:
        >>> opt = torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1)
        >>> check_release(opt, clip=None, accumulation_steps=1, scaled=False, monitor=False,
        ...               distributed=False, sharded=False, cuda_graph=False)
    """
    refused = [
        (clip is not None, "clip_grad_norm (a global norm needs every gradient at once)"),
        (accumulation_steps > 1, "accumulation_steps > 1 (accumulated gradients must live "
                                 "until the last micro-batch)"),
        (scaled, "a loss-scale manager (fp16 skips an overflowing step after backward, when "
                 "the parameters are stepped already: use dtype='bf16' or "
                 "loss_scale_manager=None)"),
        (monitor, "a monitor (it reads the gradients after backward)"),
        (distributed or sharded, "a distributed network (DDP reduces gradients after the "
                                 "hooks that step them; FSDP2 shards them)"),
        (cuda_graph, "cuda_graph (the per-parameter steps are not captured)"),
        (not isinstance(optimizer, _OPTIMIZERS),
         f"{type(optimizer).__name__} (SGD, Adam and AdamW step one parameter at a time)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"release_grads=True cannot be combined with {what}; build the "
                             "step with release_grads=False for it")


class ReleasedGradients:
    """Steps each parameter from its post-accumulate-grad hook during :meth:`stepping`,
    then frees its gradient (see the module docstring).

    Args:
        optimizer: the user's optimizer (SGD, Adam, AdamW).
        params: the parameters it trains.
        found_inf: the step's 0-dim fp32 flag (1: a non-finite loss or gradient).
        update: the 16-bit weights' update rule (``update(optimizer)``), or None for
            ``optimizer.step()``.

    Example:
        >>> released = ReleasedGradients(opt, params, found_inf)  # doctest: +SKIP
        >>> with released.stepping():  # doctest: +SKIP
        ...     loss.backward()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter],
                 found_inf: torch.Tensor,
                 update: Callable[[torch.optim.Optimizer], Any] | None = None) -> None:
        self.optimizer, self.found_inf, self.update = optimizer, found_inf, update
        self.one = torch.ones((), dtype=torch.float32, device=found_inf.device)
        self.group_of = {p: i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self.fused = update is None and getattr(optimizer, "_step_supports_amp_scaling", False)
        self.active = False
        self.stepped = 0  # parameters stepped in the last backward
        self.handles = [p.register_post_accumulate_grad_hook(self._step) for p in params]
        # a gradient handed over by parts is stepped by parts (grad_sinks.py)
        self.sunk = params
        for p in self.sunk:
            register_sink(p, self)
        self._parts: dict[torch.Tensor, _Parts] = {}  # parameters being taken by parts
        self._taken: set[torch.Tensor] = set()  # parameters taken whole in this backward

    @contextlib.contextmanager
    def stepping(self) -> Iterator[None]:
        """The body's backward steps each parameter and frees its gradient."""
        self.active, self.stepped = True, 0
        self._taken.clear()
        try:
            yield
        finally:
            self.active = False
            for p in list(self._parts):  # a backward stopped halfway: the state kept whole
                self._end(p, self._parts.pop(p))

    def _step(self, p: torch.Tensor) -> None:
        if not self.active or p.grad is None:  # a backward of the user's own: left alone
            return
        if p in self._taken:
            raise RuntimeError(
                f"release_grads: a parameter of shape {tuple(p.shape)} got a gradient from "
                "outside the op that handed its whole gradient over by parts (the fused "
                "head), after it was stepped; its graph said nothing else reads it. Build "
                "the step with head_loss='off' or release_grads=False")
        torch._amp_foreach_non_finite_check_and_unscale_([p.grad], self.found_inf, self.one)
        if self.fused or not self.found_inf.item():
            if self.update is None and p.numel() > CHUNK and p.is_contiguous() \
                    and p.grad.is_contiguous():
                self._step_in_chunks(p)
            else:
                with self._narrowed(p, p):
                    self._call()
            self.stepped += 1
        p.grad = None

    def _step_in_chunks(self, p: torch.Tensor) -> None:
        """Step ``p`` as flat chunks of ``CHUNK`` elements: each chunk a view of ``p``, its
        gradient and its state, stepped by the optimizer as a parameter of its own."""
        parts = self._begin(p)
        grad = p.grad.view(-1)
        for a in range(0, grad.numel(), CHUNK):
            self._step_part(p, parts, a, grad[a:a + CHUNK])
        self._end(p, parts)

    # the gradient sink (runtime/grad_sinks.py): a parameter's gradient handed over by parts

    def accepting(self) -> bool:
        """Whether a part handed over now is stepped: during :meth:`stepping`."""
        return self.active

    def take(self, p: torch.Tensor, start: int, grad: torch.Tensor) -> None:
        """Step ``p``'s flat elements ``[start, start + grad.numel())`` with ``grad`` (flat):
        as a chunk of :meth:`_step_in_chunks`, split where it splits; unless a gradient
        was non-finite (this one included)."""
        parts = self._parts.get(p)
        if parts is None:
            parts = self._parts[p] = self._begin(p)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], self.found_inf, self.one)
        if not self.fused and self.found_inf.item():
            return
        parts.stepped = True
        end = start + grad.numel()
        while start < end:
            stop = min(end, (start // CHUNK + 1) * CHUNK)
            self._step_part(p, parts, start, grad[:stop - start])
            grad, start = grad[stop - start:], stop

    def finish(self, p: torch.Tensor) -> None:
        """Every part of ``p``'s gradient in this backward has been taken."""
        parts = self._parts.pop(p, None)
        if parts is not None:
            self._end(p, parts)
            self.stepped += parts.stepped
        self._taken.add(p)

    def _begin(self, p: torch.Tensor) -> _Parts:
        whole = self.optimizer.state.pop(p, None) or {}  # entries p's size, and scalars
        return _Parts(dict(whole), whole)

    def _step_part(self, p: torch.Tensor, parts: _Parts, a: int, grad: torch.Tensor) -> None:
        """Step the flat elements ``[a, a + grad.numel())`` of ``p`` with ``grad``."""
        given, whole = parts.given, parts.whole
        state = self.optimizer.state
        view = p.detach().view(-1)[a:a + grad.numel()]
        view.grad = grad
        # a view of each entry the size of p; a copy of each scalar
        state[view] = {k: v.view(-1)[a:a + view.numel()] if _sized(v, p) else
                       v.clone() if isinstance(v, torch.Tensor) else v
                       for k, v in given.items()}
        with self._narrowed(p, view):
            self._call()
        for k, v in state.pop(view, {}).items():
            if not _sized(v, view):
                whole[k] = v  # the step count: each chunk's copy counts the same
                continue
            if k not in whole:  # made by the first step, a chunk's size: p's (zeros, as
                # Adam's first state, where a part is not stepped)
                whole[k] = torch.zeros(p.shape, dtype=v.dtype, device=v.device)
            part = whole[k].view(-1)[a:a + view.numel()]
            if part.data_ptr() != v.data_ptr():  # a new tensor, not the view it was given
                part.copy_(v)

    def _end(self, p: torch.Tensor, parts: _Parts) -> None:
        if parts.whole:  # plain SGD keeps none
            self.optimizer.state[p] = parts.whole

    def _call(self) -> None:
        opt = self.optimizer
        if self.update is not None:
            self.update(opt)
        elif self.fused:  # skips on the device when found_inf is 1
            opt.found_inf = self.found_inf
            try:
                opt.step()
            finally:
                del opt.found_inf
        else:
            opt.step()

    @contextlib.contextmanager
    def _narrowed(self, p: torch.Tensor, stepped: torch.Tensor) -> Iterator[None]:
        """The optimizer's groups, for one call, with ``stepped`` (``p`` or a chunk of it)
        alone in ``p``'s."""
        groups = self.optimizer.param_groups
        mine = self.group_of[p]
        saved = [g["params"] for g in groups]
        for i, g in enumerate(groups):
            g["params"] = [stepped] if i == mine else []
        try:
            yield
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    def remove(self) -> None:
        """Take the hooks off the parameters."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
        for p in self.sunk:
            unregister_sink(p, self)
        self.sunk = []


@dataclasses.dataclass
class _Parts:
    """A parameter stepped by parts: the state each part starts from (empty on the first
    step, when each part's step makes its own), the state it ends with, and whether a part
    was stepped."""

    given: dict
    whole: dict
    stepped: bool = False


def _sized(v: Any, p: torch.Tensor) -> bool:
    """Whether the state entry ``v`` is a tensor with ``p``'s elements (not a scalar)."""
    return isinstance(v, torch.Tensor) and v.dim() > 0 and v.numel() == p.numel()
