"""ampgraph/capture/logs.py: torch.export's logs are quiet while ampgraph exports."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest

from ampgraph.capture.logs import EXPORT_LOGGERS, quiet_export_logs


def test_quiet_export_logs_silences_loggers_and_stderr_but_not_warnings(capsys):
    log = logging.getLogger("torch.export")
    level = log.level
    with pytest.warns(UserWarning, match="still seen"), quiet_export_logs():
        assert log.level == logging.ERROR
        print("partial graph", file=sys.stderr)
        warnings.warn("still seen", UserWarning, stacklevel=1)
    assert log.level == level and capsys.readouterr().err == ""


def test_the_fake_tensor_kernels_error_tracebacks_are_silenced_too():
    """A user's wrong input makes a fake kernel log its traceback as an error; eager raises
    the error again, so the log is noise."""
    fake = logging.getLogger("torch._subclasses.fake_tensor")
    level = fake.level
    assert EXPORT_LOGGERS["torch._subclasses.fake_tensor"] > logging.CRITICAL
    with quiet_export_logs():
        assert not fake.isEnabledFor(logging.ERROR)
    assert fake.level == level
