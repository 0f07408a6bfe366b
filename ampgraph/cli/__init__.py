"""The ``ampgraph`` command line (docs/cli.md).

- ``main``: the argparse tree (every subcommand) and the entry point;
- ``commands``: one ``cmd_*`` function per subcommand;
- ``target``: parsing TARGET, building the model and its example inputs;
- ``inspect``, ``analysis``, ``render``, ``html_report``: ``ampgraph inspect`` and its formats;
- ``onnx_io``: ONNX loading and random feeds for ``convert``/``export``/``inspect``;
- ``bench``: ``ampgraph bench``'s interleaved timing and memory measurement.
"""

from __future__ import annotations

from ampgraph.cli.main import build_parser, main, report_main

__all__ = ["build_parser", "main", "report_main"]
