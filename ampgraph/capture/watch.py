"""What a model's Python does while torch.export traces it: the attributes its forward reads,
and the submodule calls ampgraph keeps out of the graph.

torch.export (non-strict) runs the model's own Python on fake tensors and keeps only the
tensor operations; every other value the code reads (``self.temperature``, a config flag, a
submodule's ``training``) is baked into the graph. :func:`watching` notes those reads, so
that :mod:`ampgraph.capture.guards` can check on every call that they still hold.

While the body runs, each module of the model is an instance of a *watched* subclass of its
class (made once per class, named like it; the original class is back on exit, whatever
happens): its ``__getattribute__`` records each read of an instance attribute, and each read
that found nothing (``hasattr`` false), and its ``__call__`` asks the active :class:`Watch`
whether the call is traced (``nn.Module.__call__``) or kept out of the graph (a submodule
with hooks: :mod:`ampgraph.capture.hooks`); its ``__setattr__`` and ``__delattr__`` record
what forward assigns (:mod:`ampgraph.capture.side_effects`). Plain objects a module holds
(a HuggingFace config) are not swapped: guards compare their whole ``__dict__`` instead.

Only the thread that runs the export records; other threads calling the same modules
meanwhile see their classes swapped, and run them as before.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

from torch import nn

# nn.Module's own state, which the structural guards check (not as attribute reads)
MODULE_STATE = frozenset({
    "__dict__", "__class__", "_parameters", "_buffers", "_modules",
    "_non_persistent_buffers_set", "_backward_hooks", "_backward_pre_hooks",
    "_forward_hooks", "_forward_hooks_always_called", "_forward_hooks_with_kwargs",
    "_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_is_full_backward_hook",
    "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks", "forward",
})

_local = threading.local()  # .watch: the Watch recording in this thread
_WATCHED: dict[type, type] = {}  # a class -> its watched subclass
_lock = threading.Lock()


class Watch:
    """What one export saw: ``reads`` maps ``(id(instance dict), name)`` to
    ``(instance dict, name, value)``; ``missing`` holds ``(instance dict, name)`` looked up
    and not found there. ``route`` decides each module call (see :func:`watching`).
    ``paused`` > 0 stops routing (fake runs of calls kept out of the graph trace nothing)."""

    def __init__(self, route: Callable[..., Any] | None = None) -> None:
        self.reads: dict[tuple[int, str], tuple[dict, str, Any]] = {}
        self.missing: dict[tuple[int, str], tuple[dict, str]] = {}
        self.route = route
        self.paused = 0
        self.unswapped: list[nn.Module] = []  # modules whose class could not be swapped
        self.emitted: list[int] = []  # keys of the opaque calls emitted (capture/opaque.py)
        self.stack: list[nn.Module] = []  # the modules being called, innermost last
        self.own: set[int] = set()  # ids of the fake tensors that stood in for the model's
        # attributes forward assigned or deleted: (id(instance dict), name) -> (module,
        # name, value or DELETED, the value before the first write or ABSENT);
        # torch.export puts them back afterwards, silently
        self.writes: dict[tuple[int, str], tuple[nn.Module, str, Any, Any]] = {}
        # the attributes forward wrote before reading them, and of those, the ones it read
        # back (scratch state: funnel's attention_structure.seq_len): what they held
        # before the call is never used, and forward itself uses what it wrote
        self.written_first: set[tuple[int, str]] = set()
        self.scratch: set[tuple[int, str]] = set()

    def wrote(self, obj: Any, name: str, value: Any) -> None:
        if self.paused or name in MODULE_STATE or name in (
                object.__getattribute__(obj, "__dict__").get("_buffers") or ()):
            return  # a fake run's writes are undone; a buffer assigned is traced
        d = object.__getattribute__(obj, "__dict__")
        key = (id(d), name)
        if key not in self.writes and key not in self.reads and key not in self.missing:
            self.written_first.add(key)  # (a class attribute read first is no scratch)
        before = self.writes[key][3] if key in self.writes else d.get(name, ABSENT)
        self.writes[key] = (obj, name, value, before)

    def saw(self, obj: Any, name: str, value: Any) -> None:
        if self.paused or name in MODULE_STATE:  # a call kept out of the graph: its own
            return
        d = object.__getattribute__(obj, "__dict__")
        if (id(d), name) in self.writes:  # forward's own value, not the state it was given
            if (id(d), name) in self.written_first:
                self.scratch.add((id(d), name))
            return
        if d.get(name, _ABSENT) is value:
            self.reads.setdefault((id(d), name), (d, name, value))

    def missed(self, obj: Any, name: str) -> None:
        if self.paused or name in MODULE_STATE:
            return
        d = object.__getattribute__(obj, "__dict__")
        if name not in d:
            self.missing.setdefault((id(d), name), (d, name))


_ABSENT = ABSENT = object()  # not in an instance dict
DELETED = object()  # what Watch.writes holds for an attribute forward deleted


def active() -> Watch | None:
    """The :class:`Watch` recording in this thread, or None."""
    return getattr(_local, "watch", None)


def _watched_class(cls: type) -> type:
    sub = _WATCHED.get(cls)
    if sub is not None:
        return sub
    with _lock:
        sub = _WATCHED.get(cls)
        if sub is None:
            sub = _WATCHED[cls] = _make_watched(cls)
    return sub


def _make_watched(cls: type) -> type:
    base_get = cls.__getattribute__

    def __getattribute__(self: Any, name: str) -> Any:
        try:
            value = base_get(self, name)
        except AttributeError:
            watch = getattr(_local, "watch", None)
            if watch is not None:
                watch.missed(self, name)
            raise
        watch = getattr(_local, "watch", None)
        if watch is not None:
            watch.saw(self, name, value)
        return value

    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        # looked up per call: torch.export patches nn.Module.__call__ while it traces
        watch = getattr(_local, "watch", None)
        if watch is None:
            return cls.__call__(self, *args, **kwargs)
        watch.stack.append(self)
        try:
            if watch.route is not None and not watch.paused:
                return watch.route(self, cls.__call__, args, kwargs)
            return cls.__call__(self, *args, **kwargs)
        finally:
            watch.stack.pop()

    def __setattr__(self: Any, name: str, value: Any) -> None:
        watch = getattr(_local, "watch", None)
        if watch is not None:
            watch.wrote(self, name, value)
        cls.__setattr__(self, name, value)

    def __delattr__(self: Any, name: str) -> None:
        watch = getattr(_local, "watch", None)
        if watch is not None:
            watch.wrote(self, name, DELETED)
        cls.__delattr__(self, name)

    namespace = {"__getattribute__": __getattribute__, "__call__": __call__,
                 "__setattr__": __setattr__, "__delattr__": __delattr__,
                 "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                 "__slots__": (), "_amp_watched_of": cls}
    return type(cls.__name__, (cls,), namespace)


def original_class(obj: Any) -> type:
    """``type(obj)``, or the class a watched subclass stands for."""
    cls = type(obj)
    return cls.__dict__.get("_amp_watched_of", cls)


@contextlib.contextmanager
def watching(model: nn.Module, watch: Watch | Callable[..., Any] | None = None
             ) -> Iterator[Watch]:
    """Within the block, the modules of ``model`` record the attributes read from them in
    this thread (into ``watch``, or a new :class:`Watch`, yielded), and each call of one
    goes through the watch's ``route(module, call, args, kwargs)`` (``call``: its class's
    ``__call__``) when it has one (a callable given as ``watch`` is the route).
    A module whose class cannot be swapped (a different layout) is left as it is; its
    reads go unrecorded, and :mod:`ampgraph.capture.guards` compares its whole state.

    Example:
        >>> with watching(model) as watch:
        ...     model(x)
        >>> sorted(name for _, name, _ in watch.reads.values())  # doctest: +SKIP
        ['temperature', 'training']
    """
    if not isinstance(watch, Watch):
        watch = Watch(watch)
    swapped: list[tuple[nn.Module, type]] = []
    outer = getattr(_local, "watch", None)
    try:
        for module in _unique_modules(model):
            cls = type(module)
            if "_amp_watched_of" in cls.__dict__:
                continue  # an enclosing watch swapped it
            try:
                module.__class__ = _watched_class(cls)
            except TypeError:
                watch.unswapped.append(module)
                continue
            swapped.append((module, cls))
        _local.watch = watch
        yield watch
    finally:
        _local.watch = outer
        for module, cls in reversed(swapped):
            module.__class__ = cls


@contextlib.contextmanager
def paused(watch: Watch | None) -> Iterator[None]:
    """Module calls inside the block are plain calls, and no read or write is recorded (a
    fake run of a call kept out of the graph)."""
    if watch is None:
        yield
        return
    watch.paused += 1
    try:
        yield
    finally:
        watch.paused -= 1


def _unique_modules(model: nn.Module) -> list[nn.Module]:
    return list(dict.fromkeys(m for _, m in model.named_modules(remove_duplicate=False)))
