"""Shared fixtures."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread is faster and immune to a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_leaked_trace_annotation():
    """Every test starts with no ``torch.fx.traceback`` annotation: a ``custom`` entry left
    by an earlier test (a checkpoint region's, whose generator never finished) marks every
    node a later export traces. In the full suite one such leak marked the exports of
    tests/passes/fx/test_checkpoints.py in one worker; the test that left it is not found."""
    import torch.fx.traceback as fx_traceback

    fx_traceback.current_meta.pop("custom", None)
    yield
    fx_traceback.current_meta.pop("custom", None)
