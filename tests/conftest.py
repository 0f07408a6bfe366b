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


def pytest_collection_modifyitems(config, items):
    """The tests of a module that builds something once for the module (a module- or
    session-scoped fixture of its own: the CLI runs, HF reports, exported models) share one
    xdist group: with ``--dist loadgroup`` (the README's test command) they run in one
    worker, which builds it once, instead of in each worker that gets one of them."""
    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        shared = any(d.scope in ("module", "session") and d.baseid
                     and item.nodeid.startswith(d.baseid.rstrip("/"))
                     for ds in defs.values() for d in ds)
        if shared:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))
