"""Python numbers a model takes as arguments: constants of a graph, or inputs of it.

torch.export bakes a ``float`` or ``int`` argument into the graph as a constant, so each
value would need a capture of its own (a diffusion timestep, a temperature: 40 calls,
40 graphs). Per input structure (the values left out), :class:`Numbers` notes the values
each number argument takes:

- while it has taken one value, it is a constant of the graph (the common case: a flag
  set once, ``dropout=0.1``);
- once it takes a second one, it becomes an input of the graph: export is given a 0-d
  tensor (float64, or int64) in its place, which the exported root reads back with
  ``.item()``, so the model's own code gets a symbolic number and the graph computes
  with it; every call then passes its value in such a tensor (:func:`as_tensors`);
- where export cannot take it as an input (the model branches on it, loops over it,
  makes a size of it), it stays a constant: each value gets its own graph, up to
  :data:`MAX_VALUES` per input structure; calls with further values run eagerly in fp32,
  with a warning naming the argument.

``bool``, ``str`` and ``None`` arguments are always constants (they select code paths).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch.utils import _pytree as pytree

MAX_VALUES = 8  # graphs per input structure for numbers that must stay constants
_DTYPES = {float: torch.float64, int: torch.int64}


def number_positions(leaves: list[Any]) -> tuple[int, ...]:
    """Positions of the ``float`` and ``int`` (not ``bool``) leaves of a call's inputs."""
    return tuple(i for i, leaf in enumerate(leaves) if type(leaf) in _DTYPES)


class Numbers:
    """What the number arguments of one input structure did; see the module docstring.

    Example:
        >>> numbers = Numbers()
        >>> numbers.note([x, 0.5]), numbers.note([x, 0.25]), numbers.symbolic
        (False, True, frozenset({1}))
    """

    def __init__(self) -> None:
        self.seen: dict[int, set] = {}  # position -> values seen (a few)
        self.symbolic: frozenset[int] = frozenset()  # graph inputs
        self.refused: set[int] = set()  # positions export could not take as inputs
        self.constants = 0  # graphs captured with the numbers as constants
        self.exhausted = False

    def note(self, leaves: list[Any]) -> bool:
        """Note the call's values; True when a number became a graph input."""
        grew = set()
        for i in number_positions(leaves):
            seen = self.seen.setdefault(i, set())
            if len(seen) < 2:
                seen.add(leaves[i])
            if len(seen) > 1 and i not in self.symbolic and i not in self.refused:
                grew.add(i)
        if grew:
            self.symbolic = self.symbolic | grew
        return bool(grew)

    def refuse(self, positions: frozenset[int]) -> None:
        """Export could not take ``positions`` as inputs: they stay constants."""
        self.refused |= positions
        self.symbolic = self.symbolic - positions

    def constant_capture(self, where: str, leaves: list[Any], spec: Any) -> bool:
        """A graph is to be captured with numbers as constants: whether that stays under
        :data:`MAX_VALUES`; past it, warn once (naming the arguments) and refuse."""
        if self.exhausted:
            return False
        if not self.refused or self.constants < MAX_VALUES:
            self.constants += bool(self.refused)
            return True
        self.exhausted = True
        names = ", ".join(argument_name(spec, leaves, i) for i in sorted(self.refused))
        warnings.warn(
            f"ampgraph: {where} took {MAX_VALUES} values of {names}, which its graph cannot "
            "take as an input (the model branches on it, or makes a size of it): each value "
            "was a capture of its own; calls with other values now run eagerly in fp32. "
            "Pass it as a tensor, or keep it to a few values (docs/faithfulness.md)",
            UserWarning, stacklevel=6)
        return False


def argument_name(spec: Any, leaves: list[Any], position: int) -> str:
    """``t`` or ``args[1]`` for the leaf at ``position`` of a call's ``(args, kwargs)``."""
    paths, _ = pytree.tree_flatten_with_path(pytree.tree_unflatten(list(leaves), spec))
    path = paths[position][0]
    if len(path) >= 2 and str(path[0]) == "[1]":  # kwargs
        return f"`{path[1].key}`" if hasattr(path[1], "key") else pytree.keystr(path)
    return f"positional argument {path[1].idx}" if len(path) >= 2 and hasattr(
        path[1], "idx") else pytree.keystr(path)


def as_tensors(args: tuple, kwargs: dict, positions: tuple[int, ...]) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the numbers at ``positions`` (of their leaves) as 0-d
    tensors: what a graph taking them as inputs is called with."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for i in positions:
        leaves[i] = torch.tensor(leaves[i], dtype=_DTYPES[type(leaves[i])])
    return pytree.tree_unflatten(leaves, spec)


def as_numbers(args: tuple, kwargs: dict, positions: tuple[int, ...]) -> tuple[tuple, dict]:
    """Inverse of :func:`as_tensors`, inside the traced root: ``.item()`` of each (the model
    gets a symbolic number)."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for i in positions:
        leaves[i] = leaves[i].item()
    return pytree.tree_unflatten(leaves, spec)


_STAND_INS = {float: torch.zeros((), dtype=torch.float64), int: torch.zeros((), dtype=torch.int64)}


def given_as_tensors(leaves: list[Any], positions: tuple[int, ...]) -> list[Any]:
    """A call's leaves as a graph taking the numbers at ``positions`` sees them, for
    checking which graph accepts them (a 0-d tensor of the number's kind stands in)."""
    if not positions:
        return leaves
    out = list(leaves)
    for i in positions:
        out[i] = _STAND_INS[type(leaves[i])]
    return out
