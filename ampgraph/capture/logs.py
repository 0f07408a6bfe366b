"""torch.export's logging, kept quiet while ampgraph exports: ampgraph reports failures
itself (a warning, ``explain``), and a user's failed call raises the eager model's error."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator

# torch.export's chatter (0/1 specialisations, the partial graph when it fails), kept to
# errors, and the tracebacks the fake-tensor kernels log (as errors) for a shape error
# export raises anyway (a user's wrong input: eager raises it again, and that is all)
EXPORT_LOGGERS = {"torch._export.non_strict_utils": logging.ERROR,
                  "torch.fx.experimental.symbolic_shapes": logging.ERROR,
                  "torch._dynamo": logging.ERROR, "torch.export": logging.ERROR,
                  "torch._subclasses.fake_tensor": logging.CRITICAL + 1}


@contextlib.contextmanager
def quiet_export_logs() -> Iterator[None]:
    """Silence torch.export's own chatter (see the module docstring) and what it prints to
    stderr when it fails. Warnings raised meanwhile still reach the user.

    Example:
        >>> with quiet_export_logs():
        ...     ep = torch.export.export(model, (x,), strict=False)  # doctest: +SKIP
    """
    loggers = [logging.getLogger(n) for n in EXPORT_LOGGERS]
    levels = [lg.level for lg in loggers]
    for lg, level in zip(loggers, EXPORT_LOGGERS.values()):
        lg.setLevel(level)
    try:
        with warnings.catch_warnings(record=True) as caught, \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("default")
            yield
        for w in caught:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
