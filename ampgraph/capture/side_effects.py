"""Python side effects of forward: done on every call as in eager, never baked in or leaked.

torch.export runs forward's Python once, while it traces. A forward that appends to a list
(``self.log.append(h.detach())``), counts calls (``self.calls += 1``), keeps a value
(``self.last = loss.item()``) or registers a hook on a tensor (``h.register_hook(fn)``)
would do it once, with fake tensors and symbolic values, and never again. Around each
export (``capture/export.py``):

- :class:`StateSnapshot` keeps the model's Python state before the trace (each module's
  attributes, the contents of the lists, dicts and sets they hold, and of those named by
  the globals and closures of the modules' ``forward``) and compares it after;
- a change that holds a fake tensor or a symbolic value is a leak: the state is put back
  as it was, and the module that owns the changed attribute (or whose ``forward`` names
  the changed global or closure) is cut out of the graph: it runs its own code eagerly,
  every call, its children compiled; a change of the exported module itself makes it run
  its own code eagerly;
- a change of plain values (an "installed" flag) may be a one-time initialisation, as
  eager's first call would do: the model is exported once more, and only a change that
  happens again is a side effect of every call (put back, cut as above);
- :func:`traced_tensor_hooks` (around export) makes ``Tensor.register_hook`` on a traced
  tensor raise :class:`SideEffect`, naming the module whose forward called it.

Export's own bookkeeping (it puts back module attributes a trace assigned, as copies) is
undone too: the user's list objects stay the user's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from ampgraph.capture.watch import DELETED, MODULE_STATE, active

CONTAINERS = (list, dict, set)  # the containers whose contents are compared
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


class SideEffect(RuntimeError):
    """Forward does something the graph cannot repeat; ``owner`` is the module whose forward
    did it (None: unknown)."""

    def __init__(self, message: str, owner: nn.Module | None = None) -> None:
        super().__init__(message)
        self.owner = owner


@dataclasses.dataclass
class Effect:
    """One change a trace made to the model's Python state."""

    where: str  # "model.log", "the global LOG of ...forward"
    owners: tuple[nn.Module, ...]  # whose attribute, or whose forward's global or closure
    leak: bool  # the new state holds fake tensors or symbolic values
    key: tuple = ()  # ("attr", id(module), name) or ("held", id(container)): what to put back
    value: Any = None  # the new value (an attribute's, written or found; a container)

    def __str__(self) -> str:
        return f"{self.where} {'got traced values' if self.leak else 'changed'}"


class StateSnapshot:
    """The model's Python state before an export; see the module docstring.

    Example:
        >>> snap = StateSnapshot(model)
        >>> ...  # export
        >>> snap.effects(), snap.restore()  # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, name: str = "model") -> None:
        self.root = model
        self._attrs: list[tuple[str, nn.Module, dict]] = []  # (path, module, dict copy)
        self._held: dict[int, tuple[str, tuple, Any, Any]] = {}  # id -> (where, owners, ...)
        by_forward: dict[Any, list[nn.Module]] = {}
        for path, m in model.named_modules(remove_duplicate=True):
            label = f"{name}.{path}" if path else name
            attrs = {k: v for k, v in m.__dict__.items() if k not in MODULE_STATE}
            self._attrs.append((label, m, attrs))
            for k, v in attrs.items():
                self._hold(f"{label}.{k}", (m,), v)
            by_forward.setdefault(_unwrapped(type(m).forward), []).append(m)
        for fn, modules in by_forward.items():
            if not isinstance(fn, types.FunctionType):
                continue
            where, owners = f"{fn.__module__}.{fn.__qualname__}", tuple(modules)
            for var in fn.__code__.co_names:
                value = fn.__globals__.get(var)
                if isinstance(value, CONTAINERS):
                    self._hold(f"the global {var} of {where}", owners, value)
            for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
                with contextlib.suppress(ValueError):  # an empty cell
                    if isinstance(cell.cell_contents, CONTAINERS):
                        self._hold(f"{var} in the closure of {where}", owners, cell.cell_contents)

    def _hold(self, where: str, owners: tuple, value: Any) -> None:
        if isinstance(value, CONTAINERS) and id(value) not in self._held:
            self._held[id(value)] = (where, owners, value, _contents(value))

    def effects(self) -> list[Effect]:
        """What the trace changed (before :meth:`restore`)."""
        out = []
        for label, m, attrs in self._attrs:
            now = m.__dict__
            for k in attrs.keys() | {k for k in now if k not in MODULE_STATE}:
                before, after = attrs.get(k, _MISSING), now.get(k, _MISSING)
                if before is after:
                    continue
                if _replaced_by_copy(before, after):  # export's own restoration
                    continue
                out.append(Effect(f"{label}.{k}", (m,), holds_traced(after), ("attr", id(m), k),
                                  after))
        for where, owners, obj, contents in self._held.values():
            if not _same_contents(obj, contents):
                out.append(Effect(where, owners, holds_traced(obj), ("held", id(obj)), obj))
        return out

    def restore(self, effects: list[Effect] | None = None) -> None:
        """Put the state back as it was: attributes, and the contents of the containers
        (the user's own objects, where export left copies); with ``effects``, only what
        they changed (one-time initialisations stay)."""
        keys = None if effects is None else {e.key for e in effects}
        for key, (_, _, obj, contents) in self._held.items():
            if keys is None or ("held", key) in keys:
                _set_contents(obj, contents)
        for _, m, attrs in self._attrs:
            now = m.__dict__
            names = [k for k in now if k not in MODULE_STATE] if keys is None else [
                k for kind, mid, k in (e for e in keys if e and e[0] == "attr") if mid == id(m)]
            for k in names:
                if k in attrs:
                    now[k] = attrs[k]
                else:
                    now.pop(k, None)

    def keep_containers(self) -> None:
        """Undo only export's copies: the user's objects back in their modules (with
        whatever the trace left in them)."""
        for _, m, attrs in self._attrs:
            for k, v in attrs.items():
                if _replaced_by_copy(v, m.__dict__.get(k)):
                    m.__dict__[k] = v


_MISSING = object()


def _unwrapped(fn: Any) -> Any:
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _contents(value: Any) -> Any:
    if isinstance(value, list):
        return list(value)
    if isinstance(value, dict):
        return list(value.items())
    return set(value)


def _same_contents(obj: Any, contents: Any) -> bool:
    now = _contents(obj)
    if isinstance(obj, set):
        return len(now) == len(contents) and all(
            any(a is b for b in contents) for a in now)
    if len(now) != len(contents):
        return False
    if isinstance(obj, dict):
        return all(k1 == k2 and v1 is v2 for (k1, v1), (k2, v2) in zip(now, contents))
    return all(a is b for a, b in zip(now, contents))


def _set_contents(obj: Any, contents: Any) -> None:
    if isinstance(obj, list):
        obj[:] = contents
    elif isinstance(obj, dict):
        obj.clear()
        obj.update(contents)
    else:
        obj.clear()
        obj.update(contents)


def _replaced_by_copy(before: Any, after: Any) -> bool:
    """torch.export puts back module attributes as ``tree_map`` copies: a list, dict or set
    (whose contents the held copies judge), a tuple of the same leaves."""
    if before is after or type(before) is not type(after):
        return False
    if isinstance(before, CONTAINERS):
        return True
    try:
        old, old_spec = pytree.tree_flatten(before)
        new, new_spec = pytree.tree_flatten(after)
    except Exception:  # noqa: BLE001 - not a pytree: not export's copy
        return False
    return old_spec == new_spec and len(old) == len(new) and all(
        a is b for a, b in zip(old, new)) and not (len(old) == 1 and old[0] is before)


def holds_traced(value: Any, own: set[int] = frozenset(), depth: int = 0) -> bool:
    """Whether ``value`` holds a fake tensor or a symbolic value (a bounded search); the
    fake tensors whose ids are in ``own`` do not count."""
    if isinstance(value, weakref.ref):  # nn.LSTM's _flat_weight_refs
        value = value()
    if isinstance(value, FakeTensor):
        return id(value) not in own
    if isinstance(value, _SYMBOLIC):
        return True
    if depth > 3:
        return False
    if isinstance(value, dict):
        return any(holds_traced(v, own, depth + 1) for v in list(value.values())[:64])
    if isinstance(value, (list, tuple, set)):
        return any(holds_traced(v, own, depth + 1) for v in list(value)[:64])
    return False


def write_effects(writes: dict, labels: dict[int, str]) -> list[Effect]:
    """The attributes forward assigned (``Watch.writes``; torch.export silently put those
    of submodules back), as effects of their modules."""
    out = []
    for (_, name), (module, _, value, before) in writes.items():
        if value is not DELETED and _equal_plain(before, value):
            continue  # the same value again (a mode flag set on every call)
        where = f"{labels.get(id(module), type(module).__name__)}.{name}"
        out.append(Effect(where, (module,), holds_traced(value), ("attr", id(module), name), value))
    return out


def reapply(writes: dict) -> None:
    """Put back the plain values forward assigned (export reverts them), as eager's first
    call leaves them: a lazy initialisation is then done."""
    for module, name, value, _ in writes.values():
        if value is DELETED:
            module.__dict__.pop(name, None)
        elif not holds_traced(value) and name not in (module.__dict__.get("_parameters") or ()) \
                and name not in (module.__dict__.get("_modules") or ()):
            module.__dict__[name] = value


def _equal_plain(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return type(a) is type(b) and isinstance(a, (bool, int, float, str)) and a == b


@contextlib.contextmanager
def undone(module: nn.Module) -> Iterator[None]:
    """What the body does to ``module``'s Python state (a fake run of its forward) is
    undone afterwards."""
    snap = StateSnapshot(module)
    try:
        yield
    finally:
        snap.restore()


_REGISTER_HOOK = torch.Tensor.register_hook


class _NoHandle:
    def remove(self) -> None:
        pass


def _register_hook(self: torch.Tensor, hook: Any) -> Any:
    watch = active()
    if watch is not None and watch.route is not None and isinstance(self, FakeTensor):
        if watch.paused:  # a fake run: the real call registers it, every call
            return _NoHandle()
        owner = watch.stack[-1] if watch.stack else None
        name = getattr(hook, "__qualname__", type(hook).__name__)
        raise SideEffect(f"forward registers a hook on a tensor ({name})", owner)
    return _REGISTER_HOOK(self, hook)


@contextlib.contextmanager
def traced_tensor_hooks() -> Iterator[None]:
    """Within the block, ``Tensor.register_hook`` on a tensor export traces raises
    :class:`SideEffect` naming the module being called (see the module docstring)."""
    torch.Tensor.register_hook = _register_hook
    try:
        yield
    finally:
        torch.Tensor.register_hook = _REGISTER_HOOK
