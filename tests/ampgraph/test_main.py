"""ampgraph/__main__.py: ``python -m ampgraph`` runs the command line."""

from __future__ import annotations


def test_cli_monitor_report_is_wired(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "ampgraph", "monitor-report", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "numerics" in proc.stderr.lower()
