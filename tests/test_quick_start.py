"""The README's Quick start and CI agree: CI runs the README's test command, fresh."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_quick_start_has_two_commands_demo_and_tests():
    demo, tests = quick_start_commands()
    assert demo.startswith("pip install -r requirements-pinned.txt") and "ampgraph.demo" in demo
    assert tests.startswith("pip install -r requirements-pinned.txt") and "pytest" in tests


def test_ci_runs_the_readme_test_command_in_a_fresh_venv_without_our_variables():
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    _, tests = quick_start_commands()
    assert script[-1] == tests
    body = "\n".join(script)
    assert "python3 -m venv" in body and "unset PYTHONDONTWRITEBYTECODE" in body
