"""Activation checkpointing seen by torch.export: :func:`marked_checkpoints` makes every
checkpointed call the model makes while it is exported trace its ops with a region mark,
which ``passes/fx/checkpoints.py``'s ``outline_checkpoints`` turns back into a checkpointed
call once the graph is rewritten.

torch.export (non-strict) inlines ``torch.utils.checkpoint.checkpoint``: its graph keeps
no trace of it, and a compiled model would keep every activation. Every form of
checkpointing reaches one of three names that ``torch.utils.checkpoint`` and
``torch.distributed._composable.checkpoint_activation`` look up when called:

- ``_checkpoint_without_reentrant_generator``: ``checkpoint(fn, ..., use_reentrant=False)``,
  however it is reached (imported by name, HuggingFace's ``_gradient_checkpointing_func``
  partial, ``checkpoint_wrapper``'s ``checkpoint_fn``, ``checkpoint_sequential``);
- ``CheckpointFunction``: the same with ``use_reentrant=True`` (outlined as non-reentrant:
  the same values and memory, the inputs' gradients given by autograd);
- the composable ``checkpoint(module)``'s own import of the generator (its forward hooks).

While export runs they are replaced by stand-ins that run the function under
``torch.fx.traceback.annotate({REGION_KEY: (id, options)})`` (with node metadata
preserved for that call only, so nodes outside regions are traced as before); the options
kept are those the outlined call can honour (``preserve_rng_state``, a selective
checkpointing ``context_fn``, ``determinism_check``, ``debug``, ``early_stop``). A region
inside a region is part of the outer one. The names are process-wide: another thread
checkpointing while a model is exported runs the stand-ins too (values unchanged, nothing
kept for recomputation).
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx.traceback as fx_traceback
import torch.utils.checkpoint as torch_checkpoint

from passes.fx.checkpoints import REGION_KEY, CheckpointWarning

_COMPOSABLE = "torch.distributed._composable.checkpoint_activation"
_GENERATOR = "_checkpoint_without_reentrant_generator"


@contextlib.contextmanager
def marked_checkpoints() -> Iterator[None]:
    """Within the block, checkpointed calls trace their ops marked by region (see the
    module docstring); the original names are back on exit, whatever happens.

    Example:
        >>> with marked_checkpoints():
        ...     ep = torch.export.export(model, (x,), strict=False)  # doctest: +SKIP
    """
    marker = _RegionMarker()
    patches = [(torch_checkpoint, _GENERATOR, marker.generator),
               (torch_checkpoint, "CheckpointFunction", marker.reentrant)]
    composable = sys.modules.get(_COMPOSABLE)
    if composable is not None and hasattr(composable, _GENERATOR):
        patches.append((composable, _GENERATOR, marker.composable_generator))
    saved = [(owner, name, getattr(owner, name)) for owner, name, _ in patches]
    original = saved[0][2]
    meta = fx_traceback.current_meta
    had_custom, custom = "custom" in meta, meta.get("custom")
    for owner, name, value in patches:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        marker.close()
        # the composable checkpoint imported while patched bound the stand-in: unbind it
        composable = sys.modules.get(_COMPOSABLE)
        if getattr(getattr(composable, _GENERATOR, None), "__self__", None) is marker:
            setattr(composable, _GENERATOR, original)
        # and no region's annotation outlives the export, however its generator ended
        meta = fx_traceback.current_meta
        if had_custom:
            meta["custom"] = custom
        else:
            meta.pop("custom", None)


class _RegionMarker:
    """The stand-ins of one export: region ids in call order, the open regions (closed on
    exit should export fail inside one)."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._depth = 0
        self._open: list[Any] = []
        # the stand-in for CheckpointFunction: ``CheckpointFunction.apply(fn, preserve, *args)``
        self.reentrant = type("MarkedCheckpointFunction", (), {
            "apply": staticmethod(self._apply_reentrant)})

    @contextlib.contextmanager
    def region(self, options: dict[str, Any]) -> Iterator[None]:
        if self._depth:  # nested: the outer region recomputes it
            yield
            return
        self._depth += 1
        rid = next(self._ids)
        if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            warnings.warn(
                f"ampgraph: checkpointed region {rid} is called inside saved-tensor hooks "
                "(torch.autograd.graph.save_on_cpu, transformers' activation checkpointing "
                "with offload=True): the compiled graph recomputes the region but does not "
                "run those hooks; call the model inside them instead", CheckpointWarning,
                stacklevel=2)
        try:
            with fx_traceback.preserve_node_meta(), \
                    fx_traceback.annotate({REGION_KEY: (rid, options)}):
                yield
        finally:
            self._depth -= 1

    def generator(self, fn: Callable, preserve_rng_state: bool = True,
                  context_fn: Callable = torch_checkpoint.noop_context_fn,
                  determinism_check: str = torch_checkpoint._DEFAULT_DETERMINISM_MODE,
                  debug: bool = False, early_stop: bool = True, *args: Any, **kwargs: Any
                  ) -> Iterator[None]:
        options: dict[str, Any] = {"preserve_rng_state": preserve_rng_state,
                                   "determinism_check": determinism_check, "debug": debug,
                                   "early_stop": early_stop}
        if context_fn is not torch_checkpoint.noop_context_fn:
            options["context_fn"] = context_fn  # selective checkpointing's policy
        return self._opened(options)

    def composable_generator(self, fn: Callable, preserve_rng_state: bool = True,
                             context_fn: Any = None, determinism_check: str = "default",
                             debug: bool = False, early_stop: bool = True, *args: Any,
                             **kwargs: Any) -> Iterator[None]:
        # its context_fn wraps the module's hook switch, which the outlined call has no use for
        return self._opened({"preserve_rng_state": preserve_rng_state,
                             "determinism_check": determinism_check, "debug": debug,
                             "early_stop": early_stop})

    def _opened(self, options: dict[str, Any]) -> Iterator[None]:
        gen = self._one_region(options)
        self._open.append(gen)
        return gen

    def _one_region(self, options: dict[str, Any]) -> Iterator[None]:
        # the protocol of torch's generator: one yield, around the function's forward
        with self.region(options):
            yield

    def _apply_reentrant(self, function: Callable, preserve_rng_state: bool, *args: Any) -> Any:
        with self.region({"preserve_rng_state": preserve_rng_state}):
            return function(*args)

    def close(self) -> None:
        for gen in reversed(self._open):
            gen.close()
        self._open.clear()
