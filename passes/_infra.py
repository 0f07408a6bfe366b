"""Small pass infrastructure: results, errors that name the pass and node, a manager.

How a failure names its node: a pass walks the nodes it processes through
:func:`visiting` (``for node in visiting(graph.nodes): ...``), which records the node of
each step for the :class:`PassManager` running the pass; a pass that fails names the node
its innermost ``visiting`` loop was at (:func:`current_node`). The loop variable may have
any name, and a helper the loop body calls needs nothing. Outside a ``PassManager`` run,
``visiting`` is plain iteration. Both dialects' passes walk their nodes this way
(``fx.Node`` and ONNX ``NodeProto`` or index records: anything with a string ``.name``);
a failure outside any ``visiting`` loop names the pass only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the (possibly rewritten) graph and whether it changed."""

    graph: Any
    modified: bool


class PassError(RuntimeError):
    """A pass failed; the message names the pass and, when known, the node.

    Example:
        >>> raise PassError("verify", "conv2d", "input 0 is bf16, expected fp32")
    """

    def __init__(self, pass_name: str, node: str | None, message: str):
        self.pass_name = pass_name
        self.node = node
        where = f" at node {node!r}" if node else ""
        super().__init__(f"[{pass_name}]{where}: {message}")


class PassInputError(PassError, ValueError):
    """A pass refused its input (a model it cannot take, not a bug in the pass); a
    ``ValueError`` too, so callers that catch bad input catch it. Raised by a
    :class:`PassManager` built with ``input_errors=True`` for a pass's ``ValueError``.

    Example:
        >>> raise PassInputError("index_model", "add", "value 'h' is defined twice")
    """


class ConstantRangeWarning(UserWarning):
    """A constant outside the low dtype's range was clamped (or kept its consumer fp32)."""


def named(name: str, fn: Callable[..., PassResult], *args: Any, **kwargs: Any
          ) -> Callable[[Any], PassResult]:
    """``fn`` with its other arguments bound, as a one-argument pass called ``name``.

    Example:
        >>> PassManager([named("insert_casts", insert_casts, torch.bfloat16)]).run(gm)
    """
    def bound(graph: Any) -> PassResult:
        return fn(graph, *args, **kwargs)

    bound.__name__ = bound.__qualname__ = name
    return bound


def pass_name(p: Callable[..., Any]) -> str:
    """The name a pass is reported under: its ``__name__`` (a ``functools.partial``: its
    function's), else its class name."""
    name = getattr(p, "__name__", None)
    if name is None:
        name = getattr(getattr(p, "func", None), "__name__", None)
    return name or type(p).__name__


# The visits of the pass the PassManager is running: one [node] slot per visiting loop,
# innermost last. None outside a PassManager run (visiting then records nothing).
_VISITS: ContextVar[list[list[Any]] | None] = ContextVar("pass_visits", default=None)


def visiting(nodes: Iterable[T]) -> Iterator[T]:
    """Iterate ``nodes``, recording each as the node the running pass is processing.

    Under a :class:`PassManager`, a failure while a ``visiting`` loop is at a node names
    that node (the innermost loop's, when loops nest) by its ``.name``: walk the nodes
    themselves (``enumerate(visiting(nodes))``; the tuples of ``visiting(enumerate(nodes))``
    have no name, so a failure there names none). A loop left early (``break``, or the
    failure itself) keeps its last node until an enclosing loop moves on or the pass ends:
    a failure after a ``break`` names the node the loop stopped at. Outside a
    ``PassManager`` run it is plain iteration.

    Example:
        >>> for node in visiting(gm.graph.nodes):
        ...     rewrite(node)  # a KeyError here: PassError "[my_pass] at node 'linear'"
    """
    visits = _VISITS.get()
    if visits is None:
        yield from nodes
        return
    depth = len(visits)
    slot: list[Any] = [None]
    visits.append(slot)
    above = depth + 1
    for node in nodes:
        if len(visits) > above:  # loops nested in the last step have ended: forget them
            del visits[above:]
        slot[0] = node
        yield node
    del visits[depth:]


def current_node() -> Any | None:
    """The node the innermost :func:`visiting` loop of the running pass is at, or None
    (no ``visiting`` loop, or no :class:`PassManager` run).

    Example:
        >>> for node in visiting(gm.graph.nodes):
        ...     assert current_node() is node
    """
    visits = _VISITS.get()
    return visits[-1][0] if visits else None


def _name_of(node: Any) -> str | None:
    """A node's ``.name`` (``fx.Node``, ONNX ``NodeProto``) when it is a non-empty string."""
    name = getattr(node, "name", None)
    return name if isinstance(name, str) and name else None


class PassManager:
    """Runs passes in order; each is ``fn(graph) -> PassResult``.

    A pass that fails surfaces as :class:`PassError` naming it and, when known, the node it
    was processing: a ``PassError`` raised by the pass passes through as it is; any other
    exception is wrapped (chained as its ``__cause__``), the pass named by
    :func:`pass_name` and the node by the pass's innermost :func:`visiting` loop (none when
    no loop was at a node, or its item has no name). A warning that a warnings filter
    turned into an exception is the caller's choice, not a failure: it passes through.

    With ``input_errors`` a ``ValueError`` is the input's fault (the passes raise it for a
    model they cannot take): it is wrapped as :class:`PassInputError`, which is a
    ``ValueError`` still, its message without the exception's type.

    Example:
        >>> PassManager([fold_casts, named("verify", verify, torch.bfloat16)]).run(gm)
    """

    def __init__(self, passes: Sequence[Callable[[Any], PassResult]], *,
                 input_errors: bool = False):
        self.passes = list(passes)
        self.input_errors = input_errors

    def run(self, graph: Any) -> PassResult:
        modified = False
        for p in self.passes:
            visits: list[list[Any]] = []
            token = _VISITS.set(visits)
            try:
                result = p(graph)
            except (PassError, Warning):
                raise
            except Exception as exc:  # name the pass that broke, and its node
                node = _name_of(visits[-1][0]) if visits else None
                if self.input_errors and isinstance(exc, ValueError):
                    raise PassInputError(pass_name(p), node, str(exc)) from exc
                raise PassError(pass_name(p), node,
                                f"{type(exc).__name__}: {exc}") from exc
            finally:
                _VISITS.reset(token)
            graph = result.graph
            modified |= result.modified
        return PassResult(graph, modified)
