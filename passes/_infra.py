"""Small pass infrastructure: results, errors that name the pass and node, a manager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any


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


def failing_node(tb: TracebackType | None) -> str | None:
    """The name of the node a pass was processing when it raised, from its traceback.

    The frames are searched from the innermost outward; the first one with a local variable
    called ``node`` holding an object with a string ``.name`` (an ``fx.Node``, an ONNX
    ``NodeProto``) names it. Passes keep the node they work on in a local called ``node``
    (``for node in graph.nodes: ...``), so this costs the passes nothing; a frame inside
    torch that has a ``node`` local of its own may name the node it was handed instead,
    which is the node being processed as well. None when no frame has one.
    """
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        node = frame.f_locals.get("node")
        name = getattr(node, "name", None)
        if isinstance(name, str) and name:
            return name
    return None


class PassManager:
    """Runs passes in order; each is ``fn(graph) -> PassResult``.

    A pass that fails surfaces as :class:`PassError` naming it and, when known, the node it
    was processing: a ``PassError`` raised by the pass passes through as it is; any other
    exception is wrapped (chained as its ``__cause__``), the pass named by
    :func:`pass_name` and the node found by :func:`failing_node`. A warning that a warnings
    filter turned into an exception is the caller's choice, not a failure: it passes through.

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
            try:
                result = p(graph)
            except (PassError, Warning):
                raise
            except Exception as exc:  # name the pass that broke, and its node
                node = failing_node(exc.__traceback__)
                if self.input_errors and isinstance(exc, ValueError):
                    raise PassInputError(pass_name(p), node, str(exc)) from exc
                raise PassError(pass_name(p), node, f"{type(exc).__name__}: {exc}") from exc
            graph = result.graph
            modified |= result.modified
        return PassResult(graph, modified)
