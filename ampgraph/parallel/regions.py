"""Regional compilation: a model compiled module by module, in place, so that a wrapper
that hooks a module's own ``forward`` (FSDP2's ``fully_shard``, activation checkpoint
wrappers) still sees each block called.

:func:`find_blocks` names the repeated blocks (HF's ``_no_split_modules``, or a
``ModuleList``'s items); :func:`compile_regions` compiles each block, and each module around
the blocks that holds parameters or buffers (embeddings, the final norm, the head, rotary
tables), all with one resolved configuration. What is left uncompiled is the code between
them, modules without parameters of their own (``glue_modules``).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import Any

from torch import nn

from ampgraph.api import compile_resolved
from ampgraph.config import ResolvedConfig
from ampgraph.module import AmpModule


def find_blocks(model: nn.Module, blocks: Iterable[Any] | None = None) -> list[str]:
    """Paths of the outermost modules of ``model`` that are blocks.

    ``blocks`` names them: module classes, class names, or module-path patterns
    (``fnmatch``: ``"model.layers.*"``). None: the classes an HF model lists in
    ``_no_split_modules``, else the items of the model's ``ModuleList``s.

    Raises:
        ValueError: no block found (name them with ``blocks=``).

    Example:
        >>> find_blocks(llama)
        ['model.layers.0', 'model.layers.1']
    """
    if blocks is None:
        names = set()
        for module in model.modules():
            names |= set(getattr(module, "_no_split_modules", None) or ())
        match = (lambda path, m: type(m).__name__ in names) if names else _in_module_list(model)
        how = f"HF's _no_split_modules {sorted(names)}" if names else "a ModuleList's items"
    else:
        wanted = list(blocks)
        for item in wanted:
            if not isinstance(item, (str, type)):
                raise TypeError(f"blocks: expected module classes, class names or module-path "
                                f"patterns, got {item!r}")

        def match(path: str, m: nn.Module) -> bool:
            return any(isinstance(m, w) if isinstance(w, type)
                       else type(m).__name__ == w or fnmatch.fnmatchcase(path, w)
                       for w in wanted)
        how = f"blocks={wanted!r}"
    found = _outermost(model, "", match)
    if not found:
        raise ValueError(f"no block of {type(model).__name__} matches {how}: name them, e.g. "
                         f"blocks=['model.layers.*'] or blocks=[MyBlock]")
    return found


def compile_regions(model: nn.Module, config: ResolvedConfig,
                    block_paths: list[str]) -> list[AmpModule]:
    """Compile ``model`` in place, region by region: each block, and each module around
    the blocks that holds parameters or buffers. Returns the compiled blocks, in order.

    A module already compiled stays as it is; the paths given to each compiled module are
    the model's, so ``module_overrides`` patterns apply as for a whole-model compile.

    Example:
        >>> blocks = compile_regions(llama, config, find_blocks(llama))
        >>> type(llama.model.embed_tokens).__name__
        'AmpModule'
    """
    wanted = set(block_paths)
    compiled: dict[str, AmpModule] = {}

    def visit(module: nn.Module, path: str) -> None:
        for name, child in list(module.named_children()):
            sub = f"{path}.{name}" if path else name
            if isinstance(child, AmpModule):
                if sub in wanted:
                    compiled[sub] = child
            elif sub in wanted:
                compiled[sub] = _replace(module, name, compile_resolved(child, config, sub))
            elif any(p.startswith(sub + ".") for p in wanted) or _is_container(child):
                visit(child, sub)
            elif _holds_state(child):
                _replace(module, name, compile_resolved(child, config, sub))

    visit(model, "")
    return [compiled[p] for p in block_paths]


def _in_module_list(model: nn.Module):
    items = {id(m) for lst in model.modules() if isinstance(lst, nn.ModuleList)
             for m in lst if _holds_state(m)}
    return lambda path, m: id(m) in items


def _outermost(module: nn.Module, path: str, match) -> list[str]:
    out = []
    for name, child in module.named_children():
        sub = f"{path}.{name}" if path else name
        out += [sub] if match(sub, child) else _outermost(child, sub, match)
    return out


def _replace(parent: nn.Module, name: str, child: nn.Module) -> nn.Module:
    setattr(parent, name, child)  # ModuleList and ModuleDict take their keys as attributes
    return child


def _is_container(module: nn.Module) -> bool:
    return type(module).forward is nn.Module.forward  # ModuleList, ModuleDict


def _holds_state(module: nn.Module) -> bool:
    return any(True for _ in module.parameters()) or any(True for _ in module.buffers())
