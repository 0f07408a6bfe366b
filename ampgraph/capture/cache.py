"""The graphs a compiled module keeps, and which one runs a call.

:class:`GraphCache` holds, per (train/eval mode, input signature), up to
:data:`MAX_GRAPHS_PER_SIGNATURE` graphs, most recently used first. A call runs the first
graph whose input shapes and guards (``capture/guards.py``) accept it:

- a graph whose guards fail only because tensors were swapped for like ones is pointed at
  them (``functional_call``); other changes mean a new capture, at most
  ``RECAPTURE_LIMIT`` times per signature (then the call runs eagerly, with a warning);
- whenever the state is no longer the last graph's, the runtime's kept weight copies are
  dropped (a change through ``.data`` shows no version);
- a number argument that takes a second value becomes an input of the graph
  (``capture/numbers.py``);
- input shapes export refused for an already captured structure run eagerly, remembered.

A capture that fails comes back as a :class:`CaptureFailure`, acted on (:meth:`commit`)
only once the eager code took the same inputs: an input the eager model rejects too is
the user's error, not a reason to give up on the model.
"""

from __future__ import annotations

import logging
import warnings
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx, nn

from ampgraph.capture.changes import Change
from ampgraph.capture.export import Captured, UnsupportedInput, export_module, signature_of
from ampgraph.capture.numbers import Numbers, given_as_tensors, number_positions
from ampgraph.capture.opaque import OpaqueCall, bind_opaque_calls, release
from ampgraph.capture.side_effects import SideEffect
from ampgraph.capture.state import preserved_global_state
from ampgraph.capture.trace import StateNotCapturable

_log = logging.getLogger("ampgraph")
MAX_GRAPHS_PER_SIGNATURE = 8
MAX_REFUSED_SHAPES = 1024  # input shapes export refused, remembered so as not to retry


@dataclass
class Compiled:
    """A captured graph after the AMP passes, with its decisions for ``explain``."""

    captured: Captured
    decisions: dict
    casts: int
    runner: Any = None  # what forward calls: the graph's code, or its compiled_runner
    opaque: list = field(default_factory=list)  # its calls kept out of the graph, bound
    ran: bool = False  # it ran once: a later error is not one of the inputs it was made for

    @property
    def gm(self) -> fx.GraphModule:
        return self.captured.gm


@dataclass
class CaptureFailure:
    """A capture that failed, not acted on yet (see the module docstring). :meth:`commit`
    makes the module fall back (``go_eager``: the first capture of an input structure, or
    a pass failure) or run those input shapes eagerly; :meth:`undo` takes that back (the
    eager code rejected the inputs too); :meth:`announce` says it."""

    reason: str  # for explain, when the module falls back
    short: str = ""  # for the warning, when only these input shapes run eagerly
    whole: bool = False  # a pass failed: the module falls back whatever the inputs
    first: bool = True  # no graph of this input structure yet
    shapes: tuple = ()  # (key, input shapes) refused when not first
    cache: GraphCache | None = None
    _done: Callable[[], None] | None = None

    def commit(self, go_eager: Callable[[str], Callable[[], None] | None]) -> None:
        if self.first or self.whole:
            self._done = go_eager(self.reason)
        elif self.cache is not None and len(self.cache.refused) < MAX_REFUSED_SHAPES:
            self.cache.refused.add(self.shapes)
            self._done = lambda: self.cache.refused.discard(self.shapes)

    def undo(self) -> None:
        if self._done is not None:
            self._done()

    def announce(self, where: str, announce_eager: Callable[[str], None]) -> None:
        if self.first or self.whole:
            announce_eager(self.reason)
        else:
            warnings.warn(f"ampgraph: {where} could not be captured for these input shapes "
                          f"({self.short}); calls with them run eagerly in fp32", UserWarning,
                          stacklevel=5)


Capture = Callable[[tuple], "Compiled | CaptureFailure"]


class GraphCache:
    """A compiled module's graphs; see the module docstring. ``graphs`` is the module's
    ``_amp_graphs``."""

    def __init__(self, where: str) -> None:
        self.graphs: OrderedDict[tuple, list[Compiled]] = OrderedDict()
        self.refused: set[tuple] = set()  # (key, input shapes) export refused
        self.recaptures = Recaptures(where)
        self.numbers: dict[tuple, Numbers] = {}  # per signature less numbers: what they did
        self.where = where
        self.last: Compiled | None = None  # the graph of the last call

    def select(self, mode: Hashable, leaves: list, spec: Any, capture: Capture,
               state_changed: Callable[[], None]) -> Compiled | CaptureFailure | None:
        """The graph that runs a call with these flattened inputs, captured with
        ``capture(numbers)`` if none does; None: run eagerly. ``mode`` keys the graphs
        apart besides the inputs (the training flag; with ``loss_only``, a pair).
        ``state_changed`` drops what the runtime kept for the last graph."""
        numbers = self._numbers(mode, leaves, spec)
        sym = tuple(sorted(numbers.symbolic)) if numbers else ()
        found = self._cached(mode, leaves, spec, sym, state_changed)
        if found is not False:
            return found
        if numbers is not None and numbers.note(leaves):  # a number took a new value
            tried = tuple(sorted(numbers.symbolic))
            found = self._cached(mode, leaves, spec, tried, state_changed)
            if found is not False:
                return found
            compiled = self._captured(mode, leaves, spec, tried, capture)
            if not isinstance(compiled, CaptureFailure):
                return compiled
            numbers.refuse(frozenset(tried) - frozenset(sym))  # it stays a constant
        if numbers is not None and not numbers.constant_capture(self.where, leaves, spec):
            return None
        return self._captured(mode, leaves, spec, sym, capture)

    def _numbers(self, mode: Hashable, leaves: list, spec: Any) -> Numbers | None:
        positions = number_positions(leaves)
        if not positions:
            return None
        key = (mode, signature_of(leaves, spec, positions))
        numbers = self.numbers.get(key)
        if numbers is None:
            numbers = self.numbers[key] = Numbers()
        return numbers

    def _cached(self, mode: Hashable, leaves: list, spec: Any, sym: tuple,
                state_changed: Callable[[], None]) -> Compiled | None | bool:
        """The cached graph that takes these inputs (the numbers at ``sym`` as inputs) in
        the model's present state; None: run eagerly; False: none, capture one."""
        key = (mode, signature_of(leaves, spec, sym))
        graphs = self.graphs.get(key, [])
        given = given_as_tensors(leaves, sym)
        stale = None
        for compiled in graphs:
            if compiled.captured.accepts_leaves(given):
                state = compiled.captured.state
                if state is None or state.check():
                    if stale is not None:  # the state went back to this graph's: first
                        graphs.remove(compiled)
                        graphs.insert(0, compiled)
                        state_changed()
                    self.last = compiled
                    return compiled
                stale = stale or compiled
        if stale is not None:
            state = stale.captured.state
            if state.take(stale.captured.repoint):
                self.last = stale
                return stale
            if self.recaptures.exhausted(key, state.changes()):
                return None
            state_changed()
        # other shapes of this structure captured: only these run eagerly if refused
        if (key, _shapes(leaves)) in self.refused:
            return None
        return False

    def _captured(self, mode: Hashable, leaves: list, spec: Any, sym: tuple,
                  capture: Capture) -> Compiled | CaptureFailure:
        key = (mode, signature_of(leaves, spec, sym))
        graphs = self.graphs.setdefault(key, [])
        compiled = capture(sym)
        if isinstance(compiled, CaptureFailure):
            if not graphs:
                del self.graphs[key]
            compiled.first, compiled.shapes, compiled.cache = not graphs, (
                key, _shapes(leaves)), self
            return compiled
        graphs.insert(0, compiled)
        del graphs[MAX_GRAPHS_PER_SIGNATURE:]
        self.last = compiled
        return compiled

    def forget(self, compiled: Compiled) -> None:
        """Drop ``compiled`` (it raised on the inputs it was captured for)."""
        for key, graphs in list(self.graphs.items()):
            if compiled in graphs:
                graphs.remove(compiled)
                if not graphs:
                    del self.graphs[key]

    def all(self) -> list[Compiled]:
        return [c for graphs in self.graphs.values() for c in graphs]

    def clear(self) -> None:
        self.graphs.clear()
        self.recaptures.clear()
        self.numbers.clear()


RECAPTURE_LIMIT = 8  # captures again per input structure, as dynamo's recompile_limit


class Recaptures:
    """How often a module was captured again because its guards failed, per input
    structure; past :data:`RECAPTURE_LIMIT` that structure runs eagerly, with a warning
    naming what kept changing.

    Example:
        >>> recaptures = Recaptures("model")
        >>> recaptures.exhausted(key, [Change("model.t", "1.0 -> 2.0")])
        False
    """

    def __init__(self, where: str) -> None:
        self.where = where
        self._counts: dict[Any, int] = {}
        self._exhausted: set[Any] = set()

    def exhausted(self, key: Any, changes: list[Change]) -> bool:
        """Note a recapture of ``key`` for ``changes``; whether ``key`` now runs eagerly."""
        if key in self._exhausted:
            return True
        count = self._counts[key] = self._counts.get(key, 0) + 1
        what = "; ".join(str(c) for c in changes[:4]) + ("; ..." if len(changes) > 4 else "")
        if count <= RECAPTURE_LIMIT:
            _log.info("ampgraph: capturing %s again: %s", self.where, what)
            return False
        self._exhausted.add(key)
        warnings.warn(
            f"ampgraph: {self.where} was captured again {RECAPTURE_LIMIT} times for the same "
            f"input structure because the Python state its graph depends on changed ({what}); "
            "calls with these inputs now run eagerly in fp32. Keep such state fixed between "
            "calls, or make a value that changes every call a tensor (a buffer) or an "
            "argument (docs/faithfulness.md)", UserWarning, stacklevel=6)
        return True

    def clear(self) -> None:
        self._counts.clear()
        self._exhausted.clear()


def capture_graph(model: nn.Module, args: tuple, kwargs: dict, numbers: tuple, name: str,
                  rewrite: Callable[[fx.GraphModule], Any],
                  prepare: Callable[[OpaqueCall], None],
                  transforms: list[Callable[[fx.GraphModule], Any]],
                  runner: Callable[[fx.GraphModule], Any]) -> Compiled | CaptureFailure:
    """One capture: ``model`` exported (``export.py``), ``rewrite(gm)`` (the AMP passes:
    decisions and casts), its opaque calls bound (``prepare`` sees each), ``transforms``
    run, ``runner(gm)`` made; grad and inference mode, autocast, the default dtype and RNG
    as they were. A failure comes back as a :class:`CaptureFailure` saying why."""
    with preserved_global_state():
        try:
            captured = export_module(model, args, kwargs, name, numbers)
        except Exception as exc:  # untraceable code: the children are compiled on their own
            reason = (f"input not capturable: {exc}" if isinstance(exc, UnsupportedInput)
                      else str(exc) if isinstance(exc, (SideEffect, StateNotCapturable))
                      else f"torch.export failed: {first_line(exc)}")
            return CaptureFailure(reason, first_line(exc))
        try:
            result = rewrite(captured.gm)
            opaque = bind_opaque_calls(captured.gm, prepare)
        except Exception as exc:
            release(captured.opaque_keys)
            return CaptureFailure(f"ampgraph pass failed: {first_line(exc)}", whole=True)
        for transform in transforms:
            transform(captured.gm)
        return Compiled(captured, result.decisions, result.casts, runner(captured.gm), opaque)


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``, at most 300 characters."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _shapes(leaves: list) -> tuple:
    return tuple(t.shape for t in leaves if isinstance(t, torch.Tensor))
