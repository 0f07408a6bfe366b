"""The module tree of an ``inspect`` report: what the HTML page shows first.

A user thinks in modules ("layer 3's attention"), not in aten nodes. Each entry of the tree
is a module path with, over its whole subtree: the matmul/conv FLOPs by precision (16-bit,
fp8, fp32), the compute ops, the parameters, the casts (a cast belongs to the module of the
op it feeds) and why its fp32 ops are fp32. Numbered siblings (a ``ModuleList``'s
``layer.0`` .. ``layer.11``) whose plans are identical fold into one entry; a numbered
block whose plan differs from its siblings' says how.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from difflib import SequenceMatcher
from typing import Any

from ampgraph.cli.render import PARAM_OPS, Inspection, is_op

FOLD_MIN = 2  # identical consecutive numbered siblings that fold into one entry
DIFF_SHOWN = 3  # differences named in a "plan differs" note


@dataclass
class ModuleEntry:
    """One module of the tree (``path`` "" is the model), its subtree's numbers."""

    path: str
    rows: list[int] = field(default_factory=list)  # row indices directly in this module
    children: list[ModuleEntry] = field(default_factory=list)
    flops: Counter = field(default_factory=Counter)  # "low" | "fp8" | "fp32" -> FLOPs
    ops: Counter = field(default_factory=Counter)  # precision -> compute ops
    params: int = 0
    casts: int = 0
    fp32_reasons: Counter = field(default_factory=Counter)
    signature: tuple = ()
    note: str = ""  # "plan differs from layer.0: ..."

    @property
    def number(self) -> bool:
        """Whether this is a numbered block (``layer.3``: a ModuleList's or Sequential's)."""
        return self.path.rpartition(".")[2].isdigit()

    @property
    def name(self) -> str:
        """``attention``, ``layer 3`` for a numbered block, ``(model)`` for the root."""
        if not self.path:
            return "(model)"
        parent, _, last = self.path.rpartition(".")
        return f"{parent.rpartition('.')[2]} {last}" if last.isdigit() and parent else last


@dataclass
class Fold:
    """Consecutive numbered siblings with one plan, shown as one entry."""

    members: list[ModuleEntry]

    @property
    def name(self) -> str:
        """``layer 0-11``."""
        return f"{self.members[0].name}-{self.members[-1].path.rpartition('.')[2]}"


def flop_class(precision: str) -> str:
    """The FLOP bar a row's precision counts in: ``low`` (bf16/fp16), ``fp8`` or ``fp32``
    (fp32, fp64 and ops without a float precision)."""
    if precision in ("bf16", "fp16"):
        return "low"
    return "fp8" if precision == "fp8" else "fp32"


def build_tree(insp: Inspection) -> ModuleEntry:
    """The module tree of ``insp``: entries in the order of their first row, with every
    number summed over the subtree and the numbered siblings' signatures compared.

    Example:
        >>> root = build_tree(inspection)
        >>> [c.path for c in root.children]
        ['embeddings', 'encoder', 'pooler']
    """
    entries: dict[str, ModuleEntry] = {"": ModuleEntry("")}

    def entry(path: str) -> ModuleEntry:
        if path not in entries:
            parent = entry(path.rpartition(".")[0] if "." in path else "")
            entries[path] = ModuleEntry(path)
            parent.children.append(entries[path])
        return entries[path]

    for i, row in enumerate(insp.nodes):
        entry(row["module"]).rows.append(i)
    for module in cast_modules(insp):
        entry(module).casts += 1
    root = entries[""]
    _sum(root, insp.nodes)
    _compare_siblings(root)
    return root


def cast_feeds(view: Any) -> dict[str, Any]:
    """Each cast of the drawn graph (by id) -> the first op it feeds (a ``ViewNode``); a
    cast that feeds no op is left out."""
    nodes = {n.id: n for n in view.nodes}
    feeds: dict[str, Any] = {}
    for a, b in view.edges:
        if a in nodes and nodes[a].kind == "cast" and a not in feeds and b in nodes \
                and nodes[b].kind == "op":
            feeds[a] = nodes[b]
    return feeds


def cast_modules(insp: Inspection) -> list[str]:
    """The module of each cast of the drawn graph: that of the op it feeds (the first
    such op; the cast's own module when it feeds none)."""
    feeds = cast_feeds(insp.view)
    return [feeds[n.id].module if n.id in feeds else n.module
            for n in insp.view.nodes if n.kind == "cast"]


def _sum(e: ModuleEntry, rows: list[dict[str, Any]]) -> None:
    own = []
    for i in e.rows:
        r = rows[i]
        if r["op"] in PARAM_OPS:
            e.params += 1
            own.append(("", "param", r["precision"]))
        elif is_op(r):
            e.ops[r["precision"]] += 1
            e.flops[flop_class(r["precision"])] += int(r.get("flops", 0) or 0)
            if r["precision"] == "fp32":
                e.fp32_reasons[r["reason"]] += 1
            own.append(("", r["op"], r["precision"]))
    sig = [*own, ("", "casts", str(e.casts))]
    for c in e.children:
        _sum(c, rows)
        e.flops.update(c.flops)
        e.ops.update(c.ops)
        e.params += c.params
        e.casts += c.casts
        e.fp32_reasons.update(c.fp32_reasons)
        rel = c.path.rpartition(".")[2]
        sig += [(f"{rel}.{p}" if p else rel, op, prec) for p, op, prec in c.signature]
    e.signature = tuple(sig)


def _compare_siblings(e: ModuleEntry) -> None:
    numbered = [c for c in e.children if c.number]
    if len(numbered) > 1:
        common, _ = Counter(c.signature for c in numbered).most_common(1)[0]
        model = next(c for c in numbered if c.signature == common)
        for c in numbered:
            if c.signature != common:
                c.note = f"plan differs from {model.name}'s: {plan_difference(c, model)}"
    for c in e.children:
        _compare_siblings(c)


def plan_difference(block: ModuleEntry, model: ModuleEntry) -> str:
    """What differs between two blocks' plans, in a few words: entries (ops, parameters,
    cast counts, by relative module) that differ, are only here or only there.

    Example:
        >>> plan_difference(layer0, layer1)
        'self_attn.q_proj aten.linear: bf16 here, fp8 there'
    """
    ours, theirs = block.signature, model.signature
    said: list[str] = []  # precision changes first, then what only one block has
    extra: list[str] = []
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, ours, theirs, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        pairs = list(zip(ours[i1:i2], theirs[j1:j2])) if tag == "replace" else []
        for (path, op, p), (path2, op2, p2) in pairs:
            where = path or block.name
            said.append(f"{where} {op}: {p} here, {p2} there" if (path, op) == (path2, op2)
                        else f"{where} {op} {p} here, {path2 or model.name} {op2} {p2} there")
        extra += [f"{path or block.name} {op} {p} only here"
                  for path, op, p in ours[i1 + len(pairs):i2]]
        extra += [f"{path or model.name} {op} {p} only there"
                  for path, op, p in theirs[j1 + len(pairs):j2]]
    counted = Counter(said + extra)
    said = [f"{n} x {text}" if n > 1 else text for text, n in counted.items()]
    more = f" (and {len(said) - DIFF_SHOWN} more)" if len(said) > DIFF_SHOWN else ""
    return "; ".join(said[:DIFF_SHOWN]) + more


def grouped(children: list[ModuleEntry]) -> list[ModuleEntry | Fold]:
    """``children`` with each run of ``FOLD_MIN`` or more consecutive numbered siblings
    of one plan folded.

    Example:
        >>> [g.name for g in grouped(layer.children)]
        ['layer 0-10', 'layer 11']
    """
    out: list[ModuleEntry | Fold] = []
    run: list[ModuleEntry] = []

    def close() -> None:
        if len(run) >= FOLD_MIN:
            out.append(Fold(list(run)))
        else:
            out.extend(run)
        run.clear()

    for c in children:
        if c.number and run and c.signature == run[-1].signature:
            run.append(c)
            continue
        close()
        if c.number:
            run.append(c)
        else:
            out.append(c)
    close()
    return out


def tree_data(root: ModuleEntry) -> dict[str, Any]:
    """The tree as the page's JSON: entries ``{p: path, n: name, f: [low, fp8, fp32 FLOPs],
    o: {precision: ops}, w: parameters, c: casts, r: [[reason, ops]] (fp32 ones, most
    first), d: note, k: children}``; a fold is ``{fold: name, m: [entries]}``."""

    def one(e: ModuleEntry) -> dict[str, Any]:
        out: dict[str, Any] = {"p": e.path, "n": e.name,
                               "f": [e.flops["low"], e.flops["fp8"], e.flops["fp32"]],
                               "o": dict(sorted(e.ops.items())), "w": e.params, "c": e.casts}
        if e.fp32_reasons:
            out["r"] = [[r, n] for r, n in e.fp32_reasons.most_common()]
        if e.note:
            out["d"] = e.note
        kids = [({"fold": g.name, "m": [one(m) for m in g.members]} if isinstance(g, Fold)
                 else one(g)) for g in grouped(e.children)]
        if kids:
            out["k"] = kids
        return out

    return one(root)


__all__ = ["Fold", "ModuleEntry", "build_tree", "cast_feeds", "cast_modules", "flop_class",
           "grouped", "plan_difference", "tree_data"]
