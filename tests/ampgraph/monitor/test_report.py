"""ampgraph/monitor/report.py: reading a log back, the text report and the plots."""

from __future__ import annotations

import json

import pytest

from ampgraph.cli import report_main
from ampgraph.monitor.history import History
from ampgraph.monitor.report import LOG_NAME, ReportError, format_report, load_history, plot_history
from tests.ampgraph.monitor.helpers import grads, run, step_record

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


# -- load_history, format_report and plot_history on a hand-written log ---------------------


def write_log(folder, records) -> None:
    folder.mkdir(exist_ok=True)
    (folder / LOG_NAME).write_text("".join(json.dumps(r) + "\n" for r in records))


START = {"kind": "start", "version": 1, "dtype": "fp16", "every": 1, "track": ["grads"]}


def test_load_history_reads_every_record_and_skips_blank_lines(tmp_path):
    write_log(tmp_path, [START, step_record(0, 1024.0, {"fc": grads(0.1)}),
                         step_record(1, 512.0, {"fc": grads(0.2)}, overflow=True)])
    with open(tmp_path / LOG_NAME, "a") as f:
        f.write("\n")
    history = load_history(tmp_path)
    assert history.steps == [0, 1] and history.scales == [1024.0, 512.0]
    assert history.skipped_steps == 1 and history.meta == START


def test_load_history_errors_name_the_file_and_line(tmp_path):
    with pytest.raises(ReportError, match="no such log directory"):
        load_history(tmp_path / "missing")
    with pytest.raises(ReportError, match=f"no {LOG_NAME} in it"):
        load_history(tmp_path)
    write_log(tmp_path, [START])
    with pytest.raises(ReportError, match="no logged step yet"):
        load_history(tmp_path)
    (tmp_path / LOG_NAME).write_text(json.dumps(START) + "\n{not json\n")
    with pytest.raises(ReportError, match=rf"{LOG_NAME}:2: not a numerics record"):
        load_history(tmp_path)
    assert issubclass(ReportError, ValueError)


def test_format_report_ranks_layers_by_peak_underflow_and_lists_diagnoses(tmp_path):
    layers = {f"fc{i}": grads(i / 100) for i in range(4)}
    write_log(tmp_path, [START, *(step_record(s, 2.0**16, layers) for s in range(3))])
    text = format_report(load_history(tmp_path), top=2)
    lines = text.splitlines()
    assert lines[0].startswith("dtype fp16, logged every 1 steps, tracked: grads; 3 logged "
                               "steps (0..2)")
    assert "loss scale: last 65536, min 65536, max 65536; skipped steps (overflow): 0" in text
    rows = [line.split()[0] for line in lines if line.startswith("fc")]
    assert rows == ["fc3", "fc2"]  # the top 2 by peak underflow
    assert "... 2 more layers (--top N)" in text and lines[-1] == "diagnoses: none"
    write_log(tmp_path, [START, *(step_record(s, 2.0**16, {"bad": grads(0.0, 5)}, True, s + 1)
                                  for s in range(3))])
    text = format_report(load_history(tmp_path))
    assert "diagnoses:" in text.splitlines() and "- ampgraph numerics: repeated overflows" in text


def test_plot_history_needs_something_logged(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_history(History(), tmp_path / "empty.png")
    history = History()
    history.add(step_record(0, 8.0, {"fc": grads(0.5)}, overflow=True))
    out = plot_history(history, tmp_path / "sub" / "one.png")
    assert out == tmp_path / "sub" / "one.png" and out.read_bytes()[:4] == b"\x89PNG"
