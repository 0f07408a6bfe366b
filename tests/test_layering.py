"""The import rules of docs/architecture.md: which folder may import which.

``passes/`` never imports ``ampgraph``; inside ``ampgraph/`` each subpackage imports only the
layers below it (the table :data:`MAY_IMPORT`); no module imports its own package's
``__init__``; importing either package pulls in nothing heavy. Every import statement
counts, including those inside functions (lazy imports are still dependencies). The
document names every module too.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

CORE = "core"  # ampgraph's top-level modules: api, config, capture, module, report
ROOT_PACKAGE = "ampgraph"  # `import ampgraph` / `from ampgraph import x`: the whole public API

# unit -> the units it may import (besides itself and passes/). Mirrors docs/architecture.md.
MAY_IMPORT: dict[str, set[str]] = {
    "runtime": set(),
    CORE: {"runtime"},
    "monitor": set(),
    "onnx": {CORE},
    "train": {CORE, "runtime", "monitor"},
    "parallel": {CORE, "runtime", "train"},
    "cli": {CORE, "runtime", "monitor", "onnx", "train", "parallel", ROOT_PACKAGE},
    "integrations": {CORE, "runtime", "monitor", "onnx", "train", "parallel", ROOT_PACKAGE},
    # entry points: the package's own __init__/__main__ and the demo script
    "entry": {CORE, "runtime", "monitor", "onnx", "train", "parallel", "cli", ROOT_PACKAGE},
}
SUBPACKAGES = {"runtime", "monitor", "onnx", "train", "parallel", "cli", "integrations"}
CORE_PACKAGES = {"capture"}  # folders of the compile path itself


def unit_of_file(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT / "ampgraph").parts
    if len(parts) > 1:
        return CORE if parts[0] in CORE_PACKAGES else parts[0]
    return "entry" if parts[0] in ("__init__.py", "__main__.py", "demo.py") else CORE


def unit_of_import(name: str) -> str:
    parts = name.split(".")
    if len(parts) == 1:
        return ROOT_PACKAGE
    return parts[1] if parts[1] in SUBPACKAGES else CORE


def imported_names(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``path``; ``from a import b`` may be a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            if node.module == "ampgraph":  # from ampgraph import cli -> ampgraph.cli
                out += [(node.lineno, f"ampgraph.{a.name}") for a in node.names
                        if a.name in SUBPACKAGES]
    return out


def violations(files: list[pathlib.Path]) -> list[str]:
    found = []
    for path in files:
        unit = unit_of_file(path)
        for line, name in imported_names(path):
            if name.split(".")[0] != "ampgraph":
                continue
            target = unit_of_import(name)
            if target != unit and target not in MAY_IMPORT[unit]:
                found.append(f"{path.relative_to(ROOT)}:{line}: {unit} imports {name}")
    return found


def test_every_ampgraph_subpackage_has_a_rule():
    dirs = {p.name for p in (ROOT / "ampgraph").iterdir() if (p / "__init__.py").exists()}
    assert dirs == SUBPACKAGES | CORE_PACKAGES


def test_ampgraph_folders_import_only_the_layers_below_them():
    assert violations(sorted((ROOT / "ampgraph").rglob("*.py"))) == []


def test_the_rule_checker_catches_a_violation(tmp_path, monkeypatch):
    fake = tmp_path / "ampgraph" / "runtime" / "bad.py"
    fake.parent.mkdir(parents=True)
    fake.write_text("def f():\n    from ampgraph.cli.main import main\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert violations([fake]) == ["ampgraph/runtime/bad.py:2: runtime imports ampgraph.cli.main"]


def test_the_architecture_names_every_module():
    """docs/architecture.md has a line for every module (by file name; a package's
    ``__init__`` is its folder's line)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    unnamed = [str(p.relative_to(ROOT)) for package in ("ampgraph", "passes")
               for p in sorted((ROOT / package).rglob("*.py"))
               if p.name != "__init__.py" and p.name not in text]
    assert unnamed == [], "add a line for each to docs/architecture.md"


def test_ampgraph_top_level_stays_small():
    top = [p.name for p in (ROOT / "ampgraph").glob("*.py")]
    assert len(top) <= 10, top


@pytest.mark.parametrize("package", ["ampgraph", "passes"])
def test_no_source_file_is_over_400_lines(package):
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / package).rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert long == {}


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_import_passes_does_not_import_ampgraph():
    out = run("import sys, passes, passes.fx, passes.paint, passes.policy; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'ampgraph'))")
    assert out == "[]"


def test_no_source_file_in_passes_mentions_an_ampgraph_import():
    offenders = [f"{p.relative_to(ROOT)}:{line}" for p in (ROOT / "passes").rglob("*.py")
                 for line, name in imported_names(p) if name.split(".")[0] == "ampgraph"]
    assert offenders == []


@pytest.mark.parametrize("dialect, other", [("fx", "onnx"), ("onnx", "fx")])
def test_pass_dialects_do_not_import_each_other(dialect, other):
    offenders = [f"{p.relative_to(ROOT)}:{line}" for p in (ROOT / "passes" / dialect).rglob("*.py")
                 for line, name in imported_names(p) if name.startswith(f"passes.{other}")]
    assert offenders == []


def test_import_ampgraph_is_lean():
    out = run("import sys, ampgraph; heavy = ['transformers', 'sklearn', 'onnxruntime', "
              "'matplotlib', 'hypothesis', 'onnxconverter_common', 'lightning', "
              "'accelerate']; print([m for m in heavy if m in sys.modules])")
    assert out == "[]"


def own_package_imports(files: list[pathlib.Path]) -> list[str]:
    """``path:line`` of every import, in a module below a package, of that package's
    ``__init__``: ``import pkg`` or ``from pkg import name`` where ``name`` is not one of its
    modules (re-exports are for callers outside; inside they make import cycles). The
    ``ampgraph`` root is left to :data:`MAY_IMPORT` (its entry points import the API)."""
    found = []
    for path in files:
        if path.name == "__init__.py":
            continue
        package = ".".join(path.parent.relative_to(ROOT).parts)
        if package == "ampgraph":
            continue
        modules = {p.stem for p in path.parent.glob("*.py")} | {
            p.name for p in path.parent.iterdir() if (p / "__init__.py").exists()}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                hit = any(a.name == package for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                hit = node.module == package and any(a.name not in modules for a in node.names)
            else:
                hit = False
            if hit:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


@pytest.mark.parametrize("package", ["ampgraph", "passes"])
def test_no_module_imports_its_own_packages_init(package):
    assert own_package_imports(sorted((ROOT / package).rglob("*.py"))) == []


def test_the_own_package_check_catches_a_re_export(tmp_path, monkeypatch):
    fold = tmp_path / "passes" / "fx" / "fold"
    fold.mkdir(parents=True)
    (fold / "__init__.py").write_text("from passes.fx.fold.casts import fold_casts\n")
    (fold / "casts.py").write_text("def fold_casts(gm):\n    return gm\n")
    (fold / "dead.py").write_text("from passes.fx.fold import casts\n"
                                  "from passes.fx.fold import fold_casts\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert own_package_imports(sorted(fold.glob("*.py"))) == ["passes/fx/fold/dead.py:2"]
