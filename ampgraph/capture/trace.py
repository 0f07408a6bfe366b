"""One faithful torch.export of a model: what ``export_module`` runs.

Around ``torch.export.export`` (non-strict), in this order:

- the process is left as it was found (``state.py``), export's logs are quiet, checkpointed
  calls trace marked (``checkpoints.py``), ``.data`` reads are traced (``data_reads.py``),
  the inputs lose the dimension marks a failed export leaves;
- global module hooks do not fire on fake tensors (``hooks.py``);
- the model's attribute reads are recorded for its guards, and calls of submodules with
  hooks, and of ``autograd.Function``s, are kept out of the graph (``watch.py``,
  ``hooks.py``, ``functions.py``, ``opaque.py``);
- the model's Python state is compared before and after (``side_effects.py``): a module
  whose forward changes it on every call is cut out of the graph and the model exported
  again; a change that recurs in the exported module's own state, a global or a closure,
  or a hook registered on a traced tensor, raises :class:`SideEffect` (that module then
  runs its own code eagerly, ``AmpModule``'s fallback);
- plain tensors in parameter slots (``torch.func.functional_call``) are exported as
  Parameters, and a tensor attribute forward read that requires grad but is neither a
  Parameter nor a buffer raises :class:`StateNotCapturable` (its gradient would be lost).

An export that fails on a guard over a size that went through a tensor is tried again
with static sizes (``dynamic_dims.static_retry``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ampgraph.capture.checkpoints import marked_checkpoints
from ampgraph.capture.data_reads import traced_data_reads
from ampgraph.capture.dynamic_dims import dynamic_spec, image_channels, static_retry
from ampgraph.capture.functions import opaque_functions
from ampgraph.capture.hooks import cut_route, quiet_global_hooks
from ampgraph.capture.logs import quiet_export_logs
from ampgraph.capture.opaque import release
from ampgraph.capture.own_state import own_caches, scratch_state
from ampgraph.capture.side_effects import (
    SideEffect,
    StateSnapshot,
    reapply,
    traced_tensor_hooks,
    write_effects,
)
from ampgraph.capture.state import clear_dim_marks, preserved_global_state, unmarked_dims
from ampgraph.capture.watch import Watch, watching

MAX_ROUNDS = 8  # exports of one capture: side effects found, cut, exported again


def traced(model: nn.Module, root: nn.Module, inputs: tuple, name: str) -> tuple[Any, Watch]:
    """``torch.export.export(root, inputs)`` of ``model`` (``root`` calls it), faithfully:
    see the module docstring. Returns the exported program and the :class:`Watch` of the
    export that produced it (its reads, its opaque calls); raises what export raises, or
    :class:`SideEffect`. The model's Python state is as eager's first call would leave it
    (one-time initialisation kept, traced values never)."""
    with _parameters_as_parameters(model):  # torch.func.functional_call's plain tensors
        ep, watch = _traced(model, root, inputs, name)
    _check_tensor_reads(model, watch, name)
    return ep, watch


def _traced(model: nn.Module, root: nn.Module, inputs: tuple, name: str) -> tuple[Any, Watch]:
    tensors = [t for t in torch.utils._pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor)]
    first = snap = StateSnapshot(model, name)
    labels = {id(m): f"{name}.{p}" if p else name for p, m in model.named_modules()}
    cut: set[int] = set()
    init_kept = False
    for _ in range(MAX_ROUNDS):
        watch = Watch(cut_route(model, cut))
        try:
            ep = _export(model, root, inputs, tensors, watch, name)
        except SideEffect as exc:
            first.restore()
            owners = () if exc.owner is None else (exc.owner,)
            _cut_or_raise(model, cut, owners, str(exc))
            continue
        except BaseException as exc:  # a value forward kept may be why export failed
            effects = [e for e in snap.effects() + write_effects(watch.writes, labels) if e.leak]
            first.restore()
            if not effects or not isinstance(exc, Exception):
                raise
            _cut_or_raise(model, cut, {o for e in effects for o in e.owners}, _what(effects),
                          exc)
            continue
        effects = own_caches(snap.effects() + write_effects(watch.writes, labels), watch.own,
                             snap)
        effects = scratch_state(effects, watch.scratch, watch.written_first, snap)
        if not effects:
            snap.keep_containers()
            return ep, watch
        release(watch.emitted)
        if not init_kept and not any(e.leak for e in effects):
            init_kept = True  # maybe eager's first call would have done them too: once more
            snap.keep_containers()
            reapply(watch.writes)
            snap = StateSnapshot(model, name)
            continue
        first.restore(effects if init_kept else None)  # what happens once stays done
        _cut_or_raise(model, cut, {o for e in effects for o in e.owners}, _what(effects))
        snap = first = StateSnapshot(model, name)
    raise SideEffect(f"forward kept changing Python state after {MAX_ROUNDS} exports")


def _what(effects: list) -> str:
    return "; ".join(str(e) for e in effects[:4]) + ("; ..." if len(effects) > 4 else "")


def _cut_or_raise(model: nn.Module, cut: set[int], owners: Any, what: str,
                  cause: BaseException | None = None) -> None:
    """Cut ``owners`` out of the next export, or raise :class:`SideEffect` when one of them
    cannot be (the model itself, one cut already, none known)."""
    owners = set(owners)
    if not owners or model in owners or any(id(o) in cut for o in owners):
        raise SideEffect(f"forward changes Python state on every call ({what})") from cause
    cut |= {id(o) for o in owners}


def _export(model: nn.Module, root: nn.Module, inputs: tuple, tensors: list[torch.Tensor],
            watch: Watch, name: str) -> Any:
    with (preserved_global_state(), quiet_export_logs(), marked_checkpoints(),
          traced_data_reads(), unmarked_dims(tensors), quiet_global_hooks(name),
          watching(model, watch), opaque_functions(), traced_tensor_hooks()):
        try:
            try:
                return torch.export.export(root, inputs, strict=False, dynamic_shapes=dynamic_spec(
                    inputs, image_channels(model)))
            except Exception as exc:
                if not static_retry(exc):
                    raise
                clear_dim_marks(tensors)  # else the failed export's marks make them dynamic
                release(watch.emitted)
                watch.emitted.clear()
                watch.writes.clear()
                return torch.export.export(root, inputs, strict=False)  # sizes via tensors
        except BaseException:
            release(watch.emitted)
            raise


@contextlib.contextmanager
def _parameters_as_parameters(model: nn.Module) -> Iterator[None]:
    """Within the block, plain tensors in parameter slots (``torch.func.functional_call``
    puts them there) are Parameters sharing their data: export takes only Parameters as
    parameters. The graph is pointed at the tensors themselves afterwards."""
    swapped = []
    for m in model.modules():
        for k, t in m._parameters.items():
            if t is not None and not isinstance(t, nn.Parameter):
                swapped.append((m._parameters, k, t))
                m._parameters[k] = nn.Parameter(t.detach(), requires_grad=t.requires_grad)
    try:
        yield
    finally:
        for params, k, t in swapped:
            params[k] = t


class StateNotCapturable(TypeError):
    """Forward reads state a graph cannot hold (a tensor attribute that requires grad): the
    module runs its own code eagerly, with this as the reason."""


def _check_tensor_reads(model: nn.Module, watch: Any, name: str) -> None:
    """Raise :class:`StateNotCapturable` when forward read a plain tensor attribute that
    requires grad (a weight a pre-forward hook computes, as the deprecated
    ``torch.nn.utils.spectral_norm`` and ``weight_norm`` do): export would detach it into
    a constant, and its gradient would be lost. That module then runs its own code."""
    paths = {id(m.__dict__): f"{name}.{p}" if p else name for p, m in model.named_modules()}
    for d, attr, value in watch.reads.values():
        if isinstance(value, torch.Tensor) and value.requires_grad \
                and not isinstance(value, nn.Parameter):
            raise StateNotCapturable(
                f"forward reads {paths.get(id(d), '?')}.{attr}, a tensor attribute that requires "
                "grad but is neither a Parameter nor a buffer (a weight computed by a hook: "
                "torch.nn.utils.spectral_norm, weight_norm); a graph would hold it as a "
                "constant and lose its gradient. torch.nn.utils.parametrizations computes "
                "such weights in the graph")


__all__ = ["MAX_ROUNDS", "SideEffect", "StateNotCapturable", "traced"]
