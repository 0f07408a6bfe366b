"""The numerics monitor: per-layer underflow/overflow statistics of a training run.

- ``numerics``: ``NumericsMonitor``, what users attach to a run;
- ``stats``: the per-tensor statistics measured on the device;
- ``history``: the logged history, its diagnosis and ``NumericsWarning``;
- ``sinks``: JSON-lines and TensorBoard writers;
- ``report``: reading a log back, the text report and the plots (the
  ``ampgraph monitor-report`` command is in ``ampgraph.cli``).
"""

from __future__ import annotations

from ampgraph.monitor.history import NumericsWarning
from ampgraph.monitor.numerics import NumericsMonitor

__all__ = ["NumericsMonitor", "NumericsWarning"]
