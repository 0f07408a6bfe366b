"""ampgraph/monitor/report.py: reading a log back, the text report and the plots."""

from __future__ import annotations

import pytest

from ampgraph.cli import report_main
from tests.ampgraph.monitor.helpers import run

pytestmark = [
    pytest.mark.filterwarnings("ignore:fp16 on a CPU:RuntimeWarning"),
    pytest.mark.usefixtures("one_thread"),
]


def test_plot_and_monitor_report(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    mon, _ = run("fp16", steps=3, overflow_at=1, log_dir=tmp_path / "log")
    png = mon.plot(tmp_path / "live.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report_main([str(tmp_path / "log"), "--plot", str(tmp_path / "cli.png")]) == 0
    out = capsys.readouterr().out
    assert "small" in out and "skipped steps (overflow): 1" in out
    assert (tmp_path / "cli.png").stat().st_size > 1000


def test_monitor_report_errors_are_one_line_exit_2(tmp_path, capsys):
    assert report_main([str(tmp_path / "missing")]) == 2
    (tmp_path / "empty").mkdir()
    assert report_main([str(tmp_path / "empty")]) == 2
    (tmp_path / "empty" / "numerics.jsonl").write_text("")
    assert report_main([str(tmp_path / "empty")]) == 2
    assert report_main([str(tmp_path), "--top", "many"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(e.startswith("ampgraph monitor-report: error:") for e in err)
    assert report_main(["--help"]) == 0
