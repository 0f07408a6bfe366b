"""Module hooks fire with real tensors, on every call, with their effect on the output.

Non-strict torch.export runs a submodule's forward, pre-forward and backward hooks once,
on fake tensors, and bakes in what they returned; a hook registered later never runs. So:

- **submodules with hooks are cut out of the graph**: while the model is exported
  (:func:`cut_route`, the route of ``capture/watch.py``), a call of a submodule that has
  hooks becomes an opaque call (:class:`ModuleCall`, ``capture/opaque.py``). At run time
  the graph calls the submodule's compiled module (an ``AmpModule`` of its own), which
  runs through the submodule's own ``nn.Module.__call__`` (:func:`call_with_hooks`): its
  hooks, and global hooks, fire as in eager, on real tensors, ``module`` being the
  submodule itself. The guards (``capture/guards.py``) see a hook added or removed later
  and the model is captured again;
- **hooks on the compiled model itself**, on the user's model object, fire the same way
  around its graph; hooks registered on the ``AmpModule`` fire as on any module;
- **global module hooks** (``register_module_forward_hook``) fire for each module called
  through ``nn.Module.__call__``: the compiled model, and modules cut out of the graph,
  not the modules inside the graph (:func:`quiet_global_hooks` keeps them from firing on
  fake tensors while export runs, and warns once).

Some hooks are traced faithfully and cut nothing: those of transformers' output capture
(``output_hidden_states``: they append to a per-call collector the traced forward
returns; at a cut they are applied in the graph to the call's outputs) and of the
composable activation checkpoint, which ``capture/checkpoints.py`` traces.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn
from torch.nn.modules import module as module_mod

from ampgraph.capture.opaque import OpaqueCall, emit
from ampgraph.capture.side_effects import undone

HOOK_KINDS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# hooks traced, not cut: (module prefix, function name or None for all); see the docstring
TRACED_HOOKS = (
    ("transformers.utils.output_capturing", None),
    ("torch.distributed._composable.checkpoint_activation", None),
    # output.requires_grad_(True) on the input embeddings, so that gradients reach frozen
    # models' adapters through *reentrant* checkpoints: ampgraph's are non-reentrant
    # (capture/checkpoints.py), which need no such flag
    ("transformers.modeling_utils", "make_inputs_require_grads"),
    ("peft.", "make_inputs_require_grad"),
)
APPLIED_AT_CUTS = (("transformers.utils.output_capturing", None),)
_GLOBAL_HOOKS = ("_global_forward_pre_hooks", "_global_forward_hooks",
                 "_global_forward_hooks_always_called", "_global_forward_hooks_with_kwargs",
                 "_global_backward_pre_hooks", "_global_backward_hooks")


def traced_hook(hook: Any, known: tuple[tuple[str, str | None], ...] = TRACED_HOOKS) -> bool:
    """Whether ``hook`` is one export traces faithfully (it cuts nothing)."""
    fn = hook.func if isinstance(hook, functools.partial) else getattr(hook, "__func__", hook)
    origin = getattr(fn, "__module__", None) or ""
    name = getattr(fn, "__name__", None)
    return any(origin.startswith(prefix) and (want is None or name == want)
               for prefix, want in known)


def untraced_hooks(module: nn.Module) -> list[tuple[str, Any]]:
    """``(kind, hook)`` of each hook of ``module`` that must run for real (not traced)."""
    d = module.__dict__
    return [(kind, hook) for kind in HOOK_KINDS for hook in (d.get(kind) or {}).values()
            if not traced_hook(hook)]


def has_untraced_hooks(module: nn.Module) -> bool:
    """:func:`untraced_hooks` is not empty (cheap: the common module has no hooks)."""
    d = module.__dict__
    if not (d["_forward_pre_hooks"] or d["_forward_hooks"] or d["_backward_pre_hooks"]
            or d["_backward_hooks"]):
        return False
    return bool(untraced_hooks(module))


class _Shadow:
    """The forward ``call_with_hooks`` puts in a module's ``__dict__`` for one call, with
    the one it displaced (``forward_of`` reads past it)."""

    __slots__ = ("fn", "displaced")

    def __init__(self, fn: Callable[..., Any], displaced: Any) -> None:
        self.fn, self.displaced = fn, displaced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)


_NONE = object()


def forward_of(module: nn.Module) -> Callable[..., Any]:
    """The module's own forward, called without hooks: an instance ``forward`` a library
    set (Accelerate's autocast wrapper), else its class's; never a shadow of
    :func:`call_with_hooks`."""
    fn = module.__dict__.get("forward", _NONE)
    while isinstance(fn, _Shadow):
        fn = fn.displaced
    if fn is _NONE:
        return type(module).forward.__get__(module)
    return fn


def call_with_hooks(module: nn.Module, forward: Callable[..., Any], args: tuple,
                    kwargs: dict) -> Any:
    """``module(*args, **kwargs)`` through its own ``nn.Module.__call__`` (every hook, as
    eager runs them, ``module`` the module itself) with ``forward`` (the compiled graph) in
    place of its forward for this call."""
    d = module.__dict__
    displaced = d.get("forward", _NONE)
    d["forward"] = _Shadow(forward, displaced)
    try:
        return module(*args, **kwargs)
    finally:
        if displaced is _NONE:
            d.pop("forward", None)
        else:
            d["forward"] = displaced


class ModuleCall(OpaqueCall):
    """A call of a submodule with hooks, kept out of the graph; at run time it calls
    ``runner`` (the submodule's own compiled module, set when the graph is bound)."""

    kind = "module with hooks"

    def __init__(self, module: nn.Module, path: str, args: tuple, kwargs: dict) -> None:
        self.module, self.path = module, path
        self.runner: Callable[..., Any] | None = None
        kinds = sorted({kind.strip("_").replace("_", " ") for kind, _ in
                        untraced_hooks(module)})
        super().__init__(f"{path} ({', '.join(kinds)})", args, kwargs)

    def prepare(self, compile_module: Callable[[Any, str], Any], prefix: str) -> None:
        self.runner = compile_module(self.module, f"{prefix}.{self.path}" if prefix else self.path)

    def run(self, args: tuple, kwargs: dict) -> Any:
        if self.runner is None:  # an unbound graph (calibration): the module in eager
            return self.module(*args, **kwargs)
        return self.runner(*args, **kwargs)

    def run_fake(self, args: tuple, kwargs: dict) -> Any:
        with undone(self.module):  # its Python side effects happen at run time, for real
            return forward_of(self.module)(*args, **kwargs)


def cut_route(root: nn.Module, cut: set[int] | None = None) -> Callable[..., Any]:
    """The watch's route while ``root`` is exported: a call of a submodule with untraced
    hooks (or whose id is in ``cut``) becomes a :class:`ModuleCall`; ``root`` itself is
    called without its hooks (``AmpModule`` fires them around the graph); any other call
    is traced as usual."""
    paths = {id(m): p for p, m in root.named_modules(remove_duplicate=False)}
    cut = cut or set()

    def route(module: nn.Module, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        if module is root:
            if has_untraced_hooks(module):
                return forward_of(module)(*args, **kwargs)
            return call(module, *args, **kwargs)
        if id(module) not in paths or not (id(module) in cut or has_untraced_hooks(module)):
            return call(module, *args, **kwargs)
        out = emit(ModuleCall(module, paths[id(module)], args, kwargs))
        for hook in list(module._forward_hooks.values()):  # their effect on the outputs
            if traced_hook(hook, APPLIED_AT_CUTS):
                result = hook(module, args, out)
                out = out if result is None else result
        return out

    return route


@contextlib.contextmanager
def quiet_global_hooks(where: str) -> Iterator[None]:
    """Global module hooks do not fire while the body runs (they would, on fake tensors,
    for every module export traces); a warning says once that they fire for the compiled
    module only (see the module docstring)."""
    saved = {name: getattr(module_mod, name) for name in _GLOBAL_HOOKS}
    if any(saved.values()):
        warnings.warn(
            f"ampgraph: global module hooks (torch.nn.modules.module.register_module_*_hook) "
            f"fire for {where} and for its submodules that run outside its graph, not for "
            "each module inside the graph (docs/faithfulness.md)", UserWarning, stacklevel=4)
    for name, value in saved.items():
        setattr(module_mod, name, type(value)())
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module_mod, name, value)
