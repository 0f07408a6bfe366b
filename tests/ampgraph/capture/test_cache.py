"""ampgraph/capture/cache.py: which graph runs a call; recaptures bounded; a failed capture
acted on only once eager took the inputs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.capture.cache import RECAPTURE_LIMIT, CaptureFailure, Recaptures, first_line
from ampgraph.capture.changes import Change


def test_recaptures_are_bounded_with_a_warning_naming_the_change():
    recaptures = Recaptures("the model")
    changes = [Change("model.t", "1.0 -> 2.0")]
    for _ in range(RECAPTURE_LIMIT):
        assert not recaptures.exhausted("key", changes)
    with pytest.warns(UserWarning, match=r"captured again 8 times .*model.t: 1.0 -> 2.0"):
        assert recaptures.exhausted("key", changes)
    assert recaptures.exhausted("key", changes) and not recaptures.exhausted("other", changes)
    recaptures.clear()
    assert not recaptures.exhausted("key", changes)


def test_the_graph_of_a_state_comes_back_first_and_the_weight_copies_go():
    """Switching a flag back finds the earlier graph (no capture), moved to the front so
    the next call checks it first; the runtime's kept copies are dropped on each switch."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)).eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(2, 4)
    cleared = []
    with torch.no_grad():
        net(x)
        runtime = net._amp_runtime
        real = runtime.clear
        runtime.clear = lambda: cleared.append(1) or real()
        model[1].train()
        net(x)
        model[1].eval()
        first = net(x)
        again = net(x)
    (graphs,) = net._amp_graphs.values()
    assert len(graphs) == 2 and len(cleared) == 2
    assert graphs[0] is net._amp_last and torch.equal(first, again)


def test_a_failure_commits_undoes_and_announces():
    refused: list = []

    class Cache:
        refused = set()

    failure = CaptureFailure("why", "short", first=False, shapes=("k", ()))
    failure.cache = Cache()
    failure.commit(lambda reason: refused.append(reason))
    assert Cache.refused == {("k", ())} and refused == []
    failure.undo()
    assert Cache.refused == set()
    with pytest.warns(UserWarning, match="could not be captured for these input shapes"):
        failure.announce("model", lambda reason: None)
    whole = CaptureFailure("export failed", whole=True)
    undone = []
    whole.commit(lambda reason: (refused.append(reason), lambda: undone.append(1))[1])
    whole.undo()
    assert refused == ["export failed"] and undone == [1]
    assert first_line(ValueError("a\nb")) == "ValueError: a"
