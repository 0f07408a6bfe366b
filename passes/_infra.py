"""Small pass infrastructure: results, errors that name the pass and node, a manager."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


class ConstantRangeWarning(UserWarning):
    """A constant outside the low dtype's range was clamped (or kept its consumer fp32)."""


class PassManager:
    """Runs passes in order; each is ``fn(graph) -> PassResult``.

    Example:
        >>> PassManager([fold_casts, verify]).run(gm)
    """

    def __init__(self, passes: Sequence[Callable[[Any], PassResult]]):
        self.passes = list(passes)

    def run(self, graph: Any) -> PassResult:
        modified = False
        for p in self.passes:
            try:
                result = p(graph)
            except PassError:
                raise
            except Exception as exc:  # name the pass that broke
                name = getattr(p, "__name__", type(p).__name__)
                raise PassError(name, None, f"{type(exc).__name__}: {exc}") from exc
            graph = result.graph
            modified |= result.modified
        return PassResult(graph, modified)
