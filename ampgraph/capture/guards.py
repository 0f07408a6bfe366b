"""Guards: the Python state a captured graph was traced with, checked on every call.

A graph is a cached answer to "what does this model compute for inputs like these, given
the Python state its forward read". torch.export bakes that state in, so a graph is only
valid while it holds. :class:`StateGuards` records it once, after a capture:

- **structure**: every module's class (a parametrization swaps it), the identity of each
  submodule, Parameter and buffer (``m.head = nn.Linear(...)``, ``functional_call``), the
  dtype and device of each Parameter and buffer, and each module's forward, pre-forward
  and backward hooks;
- **reads**: each instance attribute forward read (``self.temperature``, a submodule's
  ``training``, ``self.config``), and each one it looked for and did not find, as noted by
  :mod:`ampgraph.capture.watch`; a container read is compared by value, and a plain object
  read (a HuggingFace config, and the configs it holds) by the values of its ``__dict__``;
- **global flags** that change what export traces: the default dtype (factories),
  deterministic algorithms, the fast path of ``nn.MultiheadAttention``. (A default device
  set later without moving the model fails in eager too, loudly: not guarded.)

:meth:`StateGuards.check` compares it all with a few C-level passes over flat tuples
(identities, then lengths, dtypes and devices), as dynamo's guard manager flattens its
guards; :meth:`StateGuards.changes` says, slowly, what changed and where. A Parameter or
buffer replaced by another of the same kind, shape, dtype and device needs no new capture:
:meth:`StateGuards.rebind` points the graph at it (``torch.func.functional_call``, FSDP2's
unsharded parameters, ``load_state_dict(assign=True)``). Any other change means the graph
is stale: ``AmpModule`` captures again (bounded) or runs the call eagerly, and says why.
"""

from __future__ import annotations

import copy
import operator
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ampgraph.capture.changes import (
    HOOK_DICTS,
    MISSING,
    STATE_DICTS,
    Change,
    describe,
    entry,
    like_tensors,
    short,
    where,
)
from ampgraph.capture.watch import Watch, original_class

# the hook dicts a module call reads (the ``*_with_kwargs`` and ``always_called`` dicts only
# hold keys of entries in these)
MAX_OBJECT_DEPTH = 4  # plain objects held by plain objects (a config's sub-configs)

_getitem = operator.getitem
_contains = operator.contains
_dtype = operator.attrgetter("dtype")
_device = torch.Tensor.get_device


def global_flags() -> tuple:
    """The process-wide settings a traced graph depends on (see the module docstring)."""
    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            torch.backends.mha.get_fastpath_enabled())


GLOBAL_FLAG_NAMES = ("torch.get_default_dtype()", "torch.are_deterministic_algorithms_enabled()",
                     "torch.backends.mha.get_fastpath_enabled()")


class StateGuards:
    """The state a graph depends on, built after a capture (see the module docstring).

    Example:
        >>> guards = StateGuards(model, watch)
        >>> model.temperature = 4.0
        >>> guards.check(), [str(c) for c in guards.changes()]
        (False, ['model.temperature: 1.0 -> 4.0'])
    """

    def __init__(self, model: nn.Module, watch: Watch | None = None,
                 name: str = "model") -> None:
        self._labels: dict[int, str] = {}  # id(dict) -> what it is, for changes()
        modules = _unique_modules(model, name)
        entries: list[tuple[dict, Any]] = []  # (dict, key): each value's identity matters
        counted: list[dict] = []  # submodule, parameter and buffer dicts: their lengths
        hooks: list[dict] = []  # hook dicts: their lengths, when a hook was registered
        for path, m in modules:
            md = m.__dict__
            self._labels[id(md)] = path
            for kind in (*STATE_DICTS, *HOOK_DICTS):
                d = md.get(kind)
                if d is None:
                    continue
                self._labels[id(d)] = f"{path} {kind}"
                (counted if kind in STATE_DICTS else hooks).append(d)
                entries += [(d, k) for k in d]
        self._objects: list[tuple[str, Any, dict]] = []  # plain objects: (label, obj, snapshot)
        self._unswapped: list[tuple[str, Any, dict]] = []  # modules whose reads went unseen
        self._contents: list[tuple[str, Any, Any]] = []  # containers read: (label, obj, copy)
        absent: list[tuple[dict, str]] = []
        if watch is not None:
            seen: set[int] = set()  # plain objects and containers guarded once each
            for d, key, value in watch.reads.values():
                entries.append((d, key))
                self._held(f"{self._labels.get(id(d), '?')}.{key}", value, 0, seen)
            for d, key in watch.missing.values():
                if not _resolves_elsewhere(d, key):
                    absent.append((d, key))
            for module in watch.unswapped:  # reads unrecorded: its whole state is guarded
                path = self._labels.get(id(module.__dict__), "?")
                self._unswapped.append((path, module, _snapshot(module.__dict__, skip=True)))
        # tensors compare by identity, anything else by ==, which is identity first (a
        # float assigned again equal passes; a tensor's == is elementwise)
        tensor_entries = [e for e in entries if isinstance(e[0][e[1]], torch.Tensor)]
        plain_entries = [e for e in entries if not isinstance(e[0][e[1]], torch.Tensor)]
        self._plain_dicts = tuple(d for d, _ in plain_entries)
        self._plain_keys = tuple(k for _, k in plain_entries)
        self._tensor_dicts = tuple(d for d, _ in tensor_entries)
        self._tensor_keys = tuple(k for _, k in tensor_entries)
        self._counted = tuple(counted)
        self._hook_dicts = tuple(hooks)
        self._modules = tuple(m for _, m in modules)
        self._classes = [original_class(m) for m in self._modules]
        self._absent_dicts = tuple(d for d, _ in absent)
        self._absent_keys = tuple(k for _, k in absent)
        self._flags = global_flags()
        self._object_dicts = tuple(obj.__dict__ for _, obj, _ in self._objects)
        self._object_snaps = tuple(snap for _, _, snap in self._objects)
        self.rebind()

    def _held(self, label: str, value: Any, depth: int, seen: set[int]) -> None:
        """Guard what a read value holds beyond its identity: a container's contents, a
        plain object's attributes (recursively, a bounded depth)."""
        if id(value) in seen or depth > MAX_OBJECT_DEPTH:
            return
        seen.add(id(value))
        if isinstance(value, (list, dict, set)) and _copyable(value):
            self._contents.append((label, value, copy.deepcopy(value)))
        elif _plain_object(value):
            state = value.__dict__
            self._objects.append((label, value, _snapshot(state)))
            for k, v in state.items():
                if _plain_object(v):
                    self._held(f"{label}.{k}", v, depth + 1, seen)

    # -- the per-call check -------------------------------------------------------------

    def check(self) -> bool:
        """Whether the state is as captured: a few passes in C over flat tuples."""
        try:
            if (list(map(_getitem, self._plain_dicts, self._plain_keys)) != self._plain_values
                    or list(map(id, map(_getitem, self._tensor_dicts, self._tensor_keys)))
                    != self._tensor_ids):
                return False
        except Exception:  # noqa: BLE001 - a key removed, a value that cannot compare
            return False
        return (sum(map(len, self._counted)) == self._count
                and (RemovableHandle.next_id == self._handles or self._same_hooks())
                and list(map(type, self._modules)) == self._classes
                and list(map(_dtype, self._tensors)) == self._dtypes
                and list(map(_device, self._tensors)) == self._devices
                and not any(map(_contains, self._absent_dicts, self._absent_keys))
                and global_flags() == self._flags
                and all(map(_same_contents, self._object_dicts, self._object_snaps))
                and all(_same_contents(obj, snap) for _, obj, snap in self._contents)
                and all(_same_state(m.__dict__, snap) for _, m, snap in self._unswapped))

    def _same_hooks(self) -> bool:
        """A hook was registered somewhere since the last check (any module's or tensor's:
        ``RemovableHandle``'s counter moved): whether these modules' hooks are as captured
        (a removed one fails the identity check)."""
        if sum(map(len, self._hook_dicts)) != self._hook_count:
            return False
        self._handles = RemovableHandle.next_id
        return True

    # -- what changed ----------------------------------------------------------------------

    def changes(self) -> list[Change]:
        """What differs from the captured state, each with where it is (slow: for a failed
        :meth:`check`)."""
        out: list[Change] = []
        entries = [*zip(self._plain_dicts, self._plain_keys, self._plain_values),
                   *zip(self._tensor_dicts, self._tensor_keys, self._tensor_values)]
        for d, key, expected in entries:
            label = self._labels.get(id(d), "?")
            if key not in d:
                out.append(Change(entry(label, key), "removed"))
                continue
            now = d[key]
            if now is expected or _equal_plain(now, expected):
                continue  # an equal value assigned again: rebind() takes it
            rebindable = like_tensors(now, expected)  # a parameter, buffer or tensor read
            out.append(Change(entry(label, key), describe(expected, now), rebindable))
        for d in (*self._counted, *self._hook_dicts):
            before = {k for dd, k, _ in entries if dd is d}
            for key in d.keys() - before:
                out.append(Change(entry(self._labels.get(id(d), "?"), key),
                                  f"added ({short(d[key])})"))
        for m, cls in zip(self._modules, self._classes):
            if type(m) is not cls:
                out.append(Change(self._labels.get(id(m.__dict__), "?"),
                                  f"class {cls.__qualname__} -> {type(m).__qualname__}"))
        for t, dtype, device in zip(self._tensors, self._dtypes, self._devices):
            if t.dtype != dtype or t.get_device() != device:
                out.append(Change(self._tensor_label(t),
                                  f"{where(dtype, device)} -> {where(t.dtype, t.get_device())}"))
        for d, key in zip(self._absent_dicts, self._absent_keys):
            if key in d:
                out.append(Change(f"{self._labels.get(id(d), '?')}.{key}",
                                  f"set ({short(d[key])}); forward found none when captured"))
        for name, before, after in zip(GLOBAL_FLAG_NAMES, self._flags, global_flags()):
            if before != after:
                out.append(Change(name, f"{before} -> {after}"))
        for label, obj, snap in (*self._objects, *self._unswapped):
            for key in sorted(set(obj.__dict__) | set(snap), key=str):
                if key in _MODULE_OWN:
                    continue
                a, b = snap.get(key, MISSING), obj.__dict__.get(key, MISSING)
                if not _same_value(a, b):
                    out.append(Change(f"{label}.{key}", describe(a, b)))
        for label, obj, snap in self._contents:
            if not _same_contents(obj, snap):
                out.append(Change(label, "contents changed in place"))
        return out

    def _tensor_label(self, t: torch.Tensor) -> str:
        for d, key, value in zip(self._tensor_dicts, self._tensor_keys, self._tensor_values):
            if value is t:
                return entry(self._labels.get(id(d), "?"), key)
        return "a parameter"

    # -- taking the new state ----------------------------------------------------------------

    def take(self, repoint: Callable[[], bool]) -> bool:
        """After a failed :meth:`check`: whether the graph can take what changed (tensors
        swapped for like ones, which ``repoint`` points it at, if it can; values assigned
        again equal), taken as the captured state; False when it is stale."""
        if not all(c.rebindable for c in self.changes()) or not repoint():
            return False
        self.rebind()
        return True

    def rebind(self) -> None:
        """Take the current state as the captured one: after the graph was pointed at
        tensors swapped for like ones, or when the changes were values assigned again
        equal."""
        self._plain_values = list(map(_getitem, self._plain_dicts, self._plain_keys))
        self._tensor_values = list(map(_getitem, self._tensor_dicts, self._tensor_keys))
        self._tensor_ids = list(map(id, self._tensor_values))  # held: ids stay unique
        self._count = sum(map(len, self._counted))
        self._hook_count = sum(map(len, self._hook_dicts))
        self._handles = RemovableHandle.next_id
        tensors = [t for d in self._counted if self._labels.get(id(d), "").endswith(
            ("_parameters", "_buffers")) for t in d.values() if isinstance(t, torch.Tensor)]
        self._tensors = tuple(tensors)
        self._dtypes = list(map(_dtype, tensors))
        self._devices = list(map(_device, tensors))

    def __len__(self) -> int:
        """How many values each call compares."""
        return (len(self._plain_keys) + len(self._tensor_keys) + len(self._counted)
                + len(self._classes) + 2 * len(self._dtypes) + len(self._absent_keys)
                + len(self._flags) + len(self._objects) + len(self._contents)
                + len(self._unswapped))




def _unique_modules(model: nn.Module, name: str) -> list[tuple[str, nn.Module]]:
    out: dict[int, tuple[str, nn.Module]] = {}
    for path, m in model.named_modules(remove_duplicate=False):
        out.setdefault(id(m), (f"{name}.{path}" if path else name, m))
    return list(out.values())


def _resolves_elsewhere(d: dict, name: str) -> bool:
    """Whether a name missing from a module's ``__dict__`` is one of its parameters,
    buffers or submodules (the structural guards watch those)."""
    return any(name in (d.get(kind) or ()) for kind in STATE_DICTS)


def _plain_object(value: Any) -> bool:
    """An instance of a Python class holding its state in ``__dict__`` (a config), not a
    module, tensor, function, class, Python module or container."""
    if isinstance(value, (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType,
                          types.MethodType, list, dict, set, tuple, str, bytes)):
        return False
    cls = type(value)
    return bool(cls.__flags__ & (1 << 9)) and isinstance(getattr(value, "__dict__", None), dict)


def _copyable(value: Any) -> bool:
    """A container of plain values (no tensors, modules or objects), small enough to copy
    and compare on every call."""
    stack, n = [value], 0
    while stack:
        v = stack.pop()
        n += 1
        if n > 256:
            return False
        if isinstance(v, dict):
            stack += list(v.keys()) + list(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            stack += list(v)
        elif not isinstance(v, (type(None), bool, int, float, complex, str, bytes,
                                torch.dtype, torch.device)):
            return False
    return True


def _snapshot(state: dict, skip: bool = False) -> dict:
    """A copy of an object's ``__dict__`` whose copyable containers are deep copies (an
    in-place edit of a config's dict shows); with ``skip`` a module's own state is left
    out (the structural guards watch it)."""
    out = {}
    for k, v in state.items():
        if skip and k in ("_parameters", "_buffers", "_modules", *HOOK_DICTS):
            continue
        out[k] = copy.deepcopy(v) if isinstance(v, (list, dict, set)) and _copyable(v) else v
    return out


def _same_state(state: dict, snap: dict) -> bool:
    try:
        return all(k in state and _same_value(snap[k], state[k]) for k in snap) and \
            len(state.keys() - snap.keys() - _MODULE_OWN) == 0
    except Exception:  # noqa: BLE001 - a value whose comparison fails has changed
        return False


_MODULE_OWN = frozenset({"_parameters", "_buffers", "_modules", *HOOK_DICTS})


def _same_value(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # noqa: BLE001 - incomparable: changed
        return False


def _same_contents(obj: Any, snap: Any) -> bool:
    try:
        return bool(obj == snap)
    except Exception:  # noqa: BLE001
        return False


def _equal_plain(a: Any, b: Any) -> bool:
    """An immutable value equal to the captured one (a float assigned again)."""
    return type(a) is type(b) and isinstance(a, (bool, int, float, str, type(None))) and a == b


