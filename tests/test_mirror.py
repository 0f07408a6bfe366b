"""The tests mirror the tree: every module of ``ampgraph/`` and ``passes/`` has its test file,
``tests/<same folder>/test_<module name without leading/trailing underscores>.py`` (a
package's ``__init__.py`` needs none)."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("ampgraph", "passes")


def mirror_of(module: pathlib.Path) -> pathlib.Path:
    """``passes/fx/_torch_internals.py`` -> ``tests/passes/fx/test_torch_internals.py``."""
    rel = module.relative_to(ROOT)
    return ROOT / "tests" / rel.parent / f"test_{module.stem.strip('_')}.py"


def modules() -> list[pathlib.Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py")
                  if p.name != "__init__.py" and "__pycache__" not in p.parts)


def test_mirror_of_names_the_test_file():
    assert mirror_of(ROOT / "passes/fx/_torch_internals.py") == \
        ROOT / "tests/passes/fx/test_torch_internals.py"
    assert mirror_of(ROOT / "ampgraph/__main__.py") == ROOT / "tests/ampgraph/test_main.py"


def test_every_module_has_its_test_file():
    found = modules()
    assert len(found) > 50, "the package folders were not found"
    missing = [(m, mirror_of(m)) for m in found if not mirror_of(m).is_file()]
    assert not missing, (
        f"{len(missing)} module(s) without the test file that mirrors them (a test file per "
        "source module: tests/<same folder>/test_<module>.py):\n" + "\n".join(
            f"  {m.relative_to(ROOT)} -> {t.relative_to(ROOT)}" for m, t in missing))


def test_every_test_folder_is_a_package():
    """Test files of the same name in two folders (cpu/ and cuda/ test_runtime.py) import
    as different modules only when each folder has an ``__init__.py``."""
    folders = {mirror_of(m).parent for m in modules()} | {ROOT / "tests"}
    missing = sorted(str(f.relative_to(ROOT)) for f in folders
                     if f.is_dir() and not (f / "__init__.py").is_file())
    assert not missing, f"test folders without __init__.py: {missing}"
