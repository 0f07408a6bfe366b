"""Faithfulness: parametrized weights (spectral norm's power iteration writes its vectors
with ``out=``; orthogonal's Householder products) train and infer as in eager; the
deprecated hook-based spectral and weight norms run their module eagerly, with a warning,
rather than lose a gradient."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations

from tests.ampgraph.faithfulness.harness import MLP, Case, check, compiled_whole, inputs, step


def built(apply):
    def build():
        model = MLP()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the deprecated hook-based ones
            apply(model)
        return model
    return build


def trained(call, model):
    model.train()
    out = []
    for s in range(3):
        out += step(call, model, inputs(seed=s))
    return out + [b.clone() for b in model.buffers()]


def inferred(call, model):
    model.eval()
    with torch.no_grad():
        return [call(inputs(seed=s)) for s in range(2)]


KINDS = {
    "spectral norm": lambda m: parametrizations.spectral_norm(m.a),
    "weight norm": lambda m: parametrizations.weight_norm(m.a),
    "orthogonal": lambda m: parametrizations.orthogonal(m.b),
}
OLD = {
    "the hook-based spectral_norm": lambda m: nn.utils.spectral_norm(m.a),
    "the hook-based weight_norm": lambda m: nn.utils.weight_norm(m.a),
}
CASES = [Case(f"{name}, {mode}", built(apply), scenario, after=compiled_whole)
         for name, apply in KINDS.items()
         for mode, scenario in (("training", trained), ("inference", inferred))]
CASES += [Case(f"{name}, training", built(apply), trained,
               warns="a could not be captured whole .*requires grad")
          for name, apply in OLD.items()]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_parametrization(case):
    check(case)
