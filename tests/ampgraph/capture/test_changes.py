"""ampgraph/capture/changes.py: a change said the way a user reads it."""

from __future__ import annotations

import torch
from torch import nn

from ampgraph.capture.changes import MISSING, Change, describe, entry, like_tensors, short


def test_changes_read_as_a_user_would_say_them():
    assert str(Change("model.t", describe(1.0, 4.0))) == "model.t: 1.0 -> 4.0"
    assert describe(MISSING, 3) == "added (3)" and describe(3, MISSING) == "removed"
    assert describe(nn.Linear(2, 2), nn.ReLU()) == "a Linear replaced by a ReLU"
    assert entry("model.a _parameters", "weight") == "model.a.weight"
    assert entry("model.a _forward_hooks", 3) == "model.a forward hooks"
    assert short("x" * 50).endswith("...") and len(short("x" * 50)) == 40


def test_like_tensors_are_of_one_kind_shape_dtype_and_device():
    p = nn.Parameter(torch.zeros(2, 3))
    assert like_tensors(p, torch.ones(2, 3)), "functional_call puts plain tensors there"
    assert not like_tensors(p, torch.zeros(3, 2))
    assert not like_tensors(p, torch.zeros(2, 3, dtype=torch.float64))
    assert not like_tensors(p, 1.0)
