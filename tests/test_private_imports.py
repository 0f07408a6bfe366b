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

Private attributes of objects too: ``obj._name`` (``obj`` any expression but ``self`` or
``cls``) fails when ``_name`` is an attribute another first-party module defines (a class
body's ``_name``, annotated or assigned, or method ``def _name``; ``self._name = ...``;
``object.__setattr__(self, "_name", ...)``) and this module does not. Without types the
owner is known by the name alone: the attributes torch's and networkx's own classes define
(``nn.Module``'s ``_modules``, ``fx.Node``'s, ``nx.DiGraph``'s ``_succ`` ...) are out of
scope, and a subclass reading its base class's ``self._name`` is not checked.
"""

from __future__ import annotations

import ast
import functools
import pathlib
import sys

import networkx as nx
import torch
from torch import fx, nn

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


def defined_attributes(tree: ast.Module) -> set[str]:
    """The private attributes a module defines on its classes and their instances."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    found.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif (isinstance(node, ast.Attribute) and not isinstance(node.ctx, ast.Load)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            found.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "__setattr__" and len(node.args) >= 2
              and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            found.add(node.args[1].value)
    return {name for name in found if is_private(name)}


@functools.cache
def third_party_attributes() -> frozenset[str]:
    """Private attributes of the torch and networkx objects the code works on."""
    graph = fx.Graph()
    node = graph.placeholder("x")
    graph.output(node)
    objects = (nn.Module(), fx.GraphModule(nn.Module(), graph), graph, node, torch.zeros(1),
               torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), nx.DiGraph())
    return frozenset(name for obj in objects
                     for name in (*dir(obj), *getattr(obj, "__dict__", ())) if is_private(name))


def attribute_violations(path: pathlib.Path, defined_by: dict[str, set[str]]) -> list[str]:
    """``obj._name`` in ``path`` where another module, not this one, defines ``_name``."""
    tree = ast.parse(path.read_text(), str(path))
    here = module_name(path)
    rel = path.relative_to(ROOT).as_posix()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not is_private(node.attr):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        owners = defined_by.get(node.attr, set())
        if owners and here not in owners and node.attr not in third_party_attributes():
            found.append(f"{rel}:{node.lineno}: {ast.unparse(node)} (defined by "
                         f"{', '.join(sorted(owners))})")
    return sorted(set(found))


def scan_attributes(folders: tuple[str, ...] = FIRST_PARTY) -> list[str]:
    paths = [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]
    defined_by: dict[str, set[str]] = {}
    for p in paths:
        for name in defined_attributes(ast.parse(p.read_text(), str(p))):
            defined_by.setdefault(name, set()).add(module_name(p))
    return [v for p in paths for v in attribute_violations(p, defined_by)]


def test_no_private_name_is_imported_across_modules():
    assert scan() == [], "make the name public, or move it to the module that uses it"


def test_no_private_attribute_is_used_across_modules():
    assert scan_attributes() == [], ("give the class a public method or attribute for what "
                                     "the other module needs")


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


def test_the_attribute_scan_finds_what_it_looks_for(tmp_path, monkeypatch):
    pkg = tmp_path / "ampgraph"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "owner.py").write_text(
        "class Owner:\n"
        "    _declared: int\n"
        "    def __init__(self):\n"
        "        self._set = 1\n"
        "        object.__setattr__(self, '_hidden', 2)\n"
        "    def _method(self):\n"
        "        return self._set + other._declared\n"
        "    def copy(self):\n"
        "        twin = Owner()\n"
        "        twin._set = self._set  # its own class: fine\n"
    )
    (pkg / "user.py").write_text(
        "def use(owner, module, graph):\n"
        "    owner._method()\n"
        "    module._modules, graph._succ  # torch's, networkx's\n"
        "    return owner._set + owner._hidden + owner.public + owner._unknown\n"
    )
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert scan_attributes() == [
        "ampgraph/user.py:2: owner._method (defined by ampgraph.owner)",
        "ampgraph/user.py:4: owner._hidden (defined by ampgraph.owner)",
        "ampgraph/user.py:4: owner._set (defined by ampgraph.owner)",
    ]
