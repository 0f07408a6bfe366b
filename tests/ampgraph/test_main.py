"""ampgraph/__main__.py: ``python -m ampgraph`` runs the command line."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest


def test_cli_monitor_report_is_wired(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ampgraph", "monitor-report", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "numerics" in proc.stderr.lower()


def test_run_as_main_it_exits_with_the_commands_status(monkeypatch, tmp_path, capsys):
    import runpy

    import ampgraph

    path = str(Path(ampgraph.__file__).with_name("__main__.py"))
    monkeypatch.setattr(sys, "argv", ["ampgraph", "monitor-report", str(tmp_path / "none")])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(path, run_name="__main__")
    assert exit_.value.code == 2 and "no such log directory" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["ampgraph", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(path, run_name="__main__")
    out = capsys.readouterr().out
    assert exit_.value.code == 0 and out.startswith("usage: ampgraph")
    for command in ("inspect", "convert", "export", "bench", "monitor-report"):
        assert command in out


def test_importing_the_entry_point_runs_nothing():
    import importlib

    import ampgraph.cli

    entry = importlib.import_module("ampgraph.__main__")
    assert entry.main is ampgraph.cli.main
