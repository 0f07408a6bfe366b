"""PrecisionReport and ``explain``: what ran in which precision, and why."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ampgraph.capture.fallback import EagerPart, compiled_children
from ampgraph.config import dtype_name
from ampgraph.module import AmpModule
from ampgraph.node_rows import node_rows


@dataclass
class PrecisionReport:
    """One decision per graph node, the casts inserted and what stayed eager.

    Attributes:
        level: "O0".."O3".
        dtype: the low dtype ("bf16" | "fp16"; "fp32" at O0).
        nodes: rows with keys name, op, module, precision, reason and flops (the
            node's matmul/conv/attention FLOPs).
        casts: number of cast nodes inserted.
        eager: modules that could not be captured and ran eagerly in fp32.
    """

    level: str
    dtype: str
    nodes: list[dict[str, str]]
    casts: int
    eager: list[EagerPart] = field(default_factory=list)

    @property
    def summary(self) -> dict[str, Any]:
        counts = Counter(row["precision"] for row in self.nodes)
        ops = [r for r in self.nodes if r["reason"].startswith(("allow", "deny", "O", "clear",
                                                                 "custom", "module", "normal"))]
        return {
            "nodes": len(self.nodes),
            "by_precision": dict(sorted(counts.items())),
            "compute_nodes": len(ops),
            "casts": self.casts,
            "eager_modules": [e.path for e in self.eager],
        }

    def to_dict(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "dtype": self.dtype,
            "nodes": [dict(r) for r in self.nodes],
            "casts": self.casts,
            "eager": [asdict(e) for e in self.eager],
            "summary": self.summary,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, sort_keys=True)

    def __str__(self) -> str:
        head = ("name", "op", "module", "precision", "reason")
        rows = [tuple(r[k] for k in head) for r in self.nodes]
        widths = [min(max([len(h)] + [len(r[i]) for r in rows]), 40) for i, h in enumerate(head)]
        widths[-1] = 0

        def line(cells: tuple) -> str:
            return "  ".join(str(c)[:w].ljust(w) if w else str(c)
                             for c, w in zip(cells, widths)).rstrip()

        s = self.summary
        out = [f"ampgraph {self.level} {self.dtype}: {s['nodes']} nodes, "
               f"{self.casts} casts, by precision {s['by_precision']}"]
        for e in self.eager:
            out.append(f"EAGER (fp32) {e.path} [{e.module_type}]: {e.reason}")
        out += [line(head), line(tuple("-" * max(w, 6) for w in widths))]
        out += [line(r) for r in rows]
        return "\n".join(out)


def _run_keeping_buffers(module: nn.Module, args: tuple, kwargs: dict) -> None:
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    with torch.no_grad():
        module(*args, **kwargs)
        for b, value in saved:
            b.copy_(value)


def explain(module: nn.Module, *example_args: Any, **example_kwargs: Any) -> PrecisionReport:
    """Report, for a compiled module, the precision of every graph node and why.

    Args:
        module: a module returned by :func:`ampgraph.compile`, or a model compiled region
            by region (holding such modules, as :func:`ampgraph.shard` leaves it): its
            modules that run uncompiled are listed in ``eager``, with why.
        *example_args, **example_kwargs: inputs to capture with; optional once the module
            has run (the last graph used is reported).

    Raises:
        TypeError: ``module`` neither was returned by ``ampgraph.compile`` nor holds a
            module that was.
        ValueError: no example inputs and the module has not run yet.

    Example:
        >>> net = ampgraph.compile(model, amp_level="O2")
        >>> print(ampgraph.explain(net, torch.randn(8, 64)))
    """
    regions = [] if isinstance(module, AmpModule) else compiled_children(module, AmpModule)
    if not isinstance(module, AmpModule) and not regions:
        raise TypeError(
            f"explain expects a module returned by ampgraph.compile, got "
            f"{type(module).__name__}; call ampgraph.compile(model) first"
        )
    if example_args or example_kwargs:
        if regions or module.compiled_for(tuple(example_args), dict(example_kwargs)) is None:
            _run_keeping_buffers(module, example_args, example_kwargs)  # eager parts capture
    first = regions[0] if regions else module
    graphs, eager = _regional_parts(module) if regions else module.amp_parts()
    if not graphs and (regions or not eager):
        raise ValueError(
            "this module has not run yet: pass example inputs, "
            "e.g. ampgraph.explain(net, torch.randn(2, 3, 32, 32))"
        )
    nodes: list[dict[str, str]] = []
    casts = 0
    for prefix, compiled in graphs:
        nodes += node_rows(prefix, compiled, first.amp_dtype)
        casts += compiled.casts
    cfg = first.amp_config
    return PrecisionReport(cfg.amp_level, dtype_name(first.amp_dtype), nodes, casts, eager)


UNCOMPILED = "not compiled: runs eagerly in fp32"
GLUE = "the code between compiled modules (regional compilation): no parameters of its own"


def _regional_parts(model: nn.Module) -> tuple[list, list[EagerPart]]:
    """A model compiled region by region: its compiled modules' graphs, and its modules
    that run uncompiled (each with a forward of its own, outside every compiled module)."""
    graphs: list = []
    eager: list[EagerPart] = []

    def visit(module: nn.Module, path: str) -> None:
        if isinstance(module, AmpModule):
            g, e = module.amp_parts()
            graphs.extend(g)
            eager.extend(e)
            return
        if type(module).forward is not nn.Module.forward:  # not a ModuleList / ModuleDict
            own = any(True for _ in module.parameters(recurse=False)) or any(
                True for _ in module.buffers(recurse=False))
            eager.append(EagerPart(path or "<root>", type(module).__name__,
                                   UNCOMPILED if own else GLUE))
        for name, child in module.named_children():
            visit(child, f"{path}.{name}" if path else name)

    visit(model, "")
    return graphs, eager
