"""No private names across modules: a name another module of ampgraph/ or passes/ uses is
public.

Scans every file of ``ampgraph/`` and ``passes/`` and fails on ``from X import _name`` and on
``X._name`` where ``X`` is another first-party module (imported as ``import X``, ``import X
as m`` or ``from P import X``). Dunder names are not private; a private *module* (``from
passes import _infra``, ``passes.fx._torch_internals``) may be imported: its leading
underscore says it is internal to its package, and its names are the package's API. Private
names of third-party packages (``torch.utils._pytree``) are not checked. ruff has no rule for
this: ``PLC2701`` (import-private-name) exempts every import inside the same top-level
package, and flags torch's private modules instead.
"""

from __future__ import annotations

import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIRST_PARTY = ("ampgraph", "passes")


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def is_module(dotted: str) -> bool:
    base = ROOT.joinpath(*dotted.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def absolute(node: ast.ImportFrom, here: str, is_package: bool) -> str | None:
    if node.level == 0:
        return node.module
    parts = here.split(".")
    parts = parts[: len(parts) - node.level + (1 if is_package else 0)]
    return ".".join(parts + ([node.module] if node.module else []))


def attribute_chain(node: ast.Attribute) -> tuple[str, list[str]] | None:
    """``a.b.c`` -> ("a", ["b", "c"]); None unless the chain starts at a plain name."""
    attrs = []
    while isinstance(node, ast.Attribute):
        attrs.append(node.attr)
        node = node.value
    return (node.id, attrs[::-1]) if isinstance(node, ast.Name) else None


def violations(path: pathlib.Path) -> list[str]:
    here = module_name(path)
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).as_posix()
    found = []
    modules: dict[str, str] = {}  # local name -> the first-party module it is bound to
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] not in FIRST_PARTY:
                    continue
                if alias.asname:
                    modules[alias.asname] = alias.name
                else:
                    root = alias.name.split(".")[0]
                    modules[root] = root
        elif isinstance(node, ast.ImportFrom):
            source = absolute(node, here, is_package)
            if not source or source.split(".")[0] not in FIRST_PARTY:
                continue
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if is_module(full):
                    modules[alias.asname or alias.name] = full
                elif is_private(alias.name) and source != here:
                    found.append(f"{rel}:{node.lineno}: from {source} import {alias.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):  # a.b.c and its prefix a.b: found once
            continue
        chain = attribute_chain(node)
        if chain is None or chain[0] not in modules:
            continue
        owner = modules[chain[0]]
        for attr in chain[1]:
            if is_module(f"{owner}.{attr}"):
                owner = f"{owner}.{attr}"
                continue
            if is_private(attr) and owner != here:
                found.append(f"{rel}:{node.lineno}: {owner}.{attr}")
            break
    return sorted(set(found))


def scan(folders: tuple[str, ...] = FIRST_PARTY) -> list[str]:
    return [v for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))
            for v in violations(p)]


def test_no_private_name_is_imported_across_modules():
    assert scan() == [], "make the name public, or move it to the module that uses it"


def test_the_scan_finds_what_it_looks_for(tmp_path, monkeypatch):
    pkg = tmp_path / "ampgraph"
    (pkg / "sub").mkdir(parents=True)
    for init in (pkg / "__init__.py", pkg / "sub" / "__init__.py"):
        init.write_text("")
    (pkg / "sub" / "a.py").write_text("_hidden = 1\nshown = 2\n")
    (pkg / "sub" / "_internal.py").write_text("name = 1\n")
    bad = pkg / "bad.py"
    bad.write_text(
        "import ampgraph.sub.a\n"
        "from ampgraph.sub import a as alias\n"
        "from ampgraph.sub.a import _hidden, shown\n"
        "from ampgraph.sub import _internal\n"
        "from torch.utils import _pytree\n"
        "from .sub.a import _hidden as again\n"
        "x = ampgraph.sub.a._hidden + alias.shown + alias.__name__\n"
        "y = alias._hidden + _internal.name + _pytree.tree_map\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations(bad) == [
        "ampgraph/bad.py:3: from ampgraph.sub.a import _hidden",
        "ampgraph/bad.py:6: from ampgraph.sub.a import _hidden",
        "ampgraph/bad.py:7: ampgraph.sub.a._hidden",
        "ampgraph/bad.py:8: ampgraph.sub.a._hidden",
    ]
    own = pkg / "sub" / "a.py"
    own.write_text("import ampgraph.sub.a\n_hidden = 1\nx = ampgraph.sub.a._hidden\n")
    assert violations(own) == []
