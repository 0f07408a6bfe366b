"""ampgraph/runtime/grad_sinks.py: a parameter's sink is found by the parameter itself
(not by its values), only its owner takes it off, and it goes with the parameter."""

from __future__ import annotations

import gc

import torch

from ampgraph.runtime.grad_sinks import register_sink, sink_of, unregister_sink


class Sink:
    def accepting(self):
        return True

    def take(self, p, start, grad):
        pass

    def finish(self, p):
        pass


def test_a_sink_is_found_by_the_parameter_not_by_its_values():
    p, q = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(3))
    sink = Sink()
    register_sink(p, sink)
    try:
        assert sink_of(p) is sink and sink_of(q) is None  # equal values, another tensor
        assert sink_of(p.detach()) is None  # a view of it is not it
    finally:
        unregister_sink(p, sink)
    assert sink_of(p) is None


def test_only_the_sink_registered_takes_itself_off():
    p = torch.nn.Parameter(torch.ones(2))
    first, second = Sink(), Sink()
    register_sink(p, first)
    register_sink(p, second)  # a later step over the same parameters replaces it
    unregister_sink(p, first)  # the first one's cleanup leaves the second alone
    assert sink_of(p) is second
    unregister_sink(p, second)
    assert sink_of(p) is None


def test_a_sink_goes_with_its_parameter():
    from ampgraph.runtime import grad_sinks

    p = torch.nn.Parameter(torch.ones(2))
    register_sink(p, Sink())
    count = len(grad_sinks._SINKS)
    del p
    gc.collect()
    assert len(grad_sinks._SINKS) == count - 1
