"""ampgraph/capture/dynamic_dims.py: the dynamic dims torch.export is asked for."""

from __future__ import annotations

import torch
from torch.export import Dim

from ampgraph.capture.dynamic_dims import dynamic_spec


def test_dynamic_spec_marks_every_dimension_auto():
    spec = dynamic_spec(((torch.ones(2, 3), 1.0), {"mask": torch.ones(4), "k": None}))
    assert spec[0][0] == {0: Dim.AUTO, 1: Dim.AUTO} and spec[0][1] is None
    assert spec[1] == {"mask": {0: Dim.AUTO}, "k": None}
