"""ampgraph/capture/export.py: the exported root, dynamic dims and export's guards."""

from __future__ import annotations

import torch
from torch import nn

import ampgraph


class EvenOdd(nn.Module):
    """A branch on the batch size's parity: export guards the graph with ``% 2 == 0``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x):
        y = self.fc(x)
        return y * 2 if x.shape[0] % 2 == 0 else y * 3


def test_inputs_failing_export_s_guards_get_a_graph_of_their_own():
    """Export's guards run outside the graph, once per new input shapes: an input that fails
    one (here an odd batch after even ones; it raised "Guard failed" when the guards ran in
    the graph) is captured again, as one outside the dimension ranges is."""
    torch.manual_seed(0)
    model = EvenOdd()
    net = ampgraph.compile(model, amp_level="O2")
    with torch.no_grad():
        for n in (6, 8, 3, 5, 6):
            x = torch.randn(n, 6)
            torch.testing.assert_close(net(x), model(x), rtol=2e-2, atol=2e-2)
    (graphs,) = net._amp_graphs.values()
    assert len(graphs) == 2
    for compiled in graphs:
        assert not any(n.op == "call_module" for n in compiled.captured.gm.graph.nodes)
    calls = []
    even = next(c.captured for c in graphs if c.captured.accepts_leaves([torch.randn(4, 6)]))
    guards = even.guards
    even.guards = lambda *leaves: calls.append(len(leaves)) or guards(*leaves)
    for _ in range(3):
        assert even.accepts_leaves([torch.randn(10, 6)])
    assert not even.accepts_leaves([torch.randn(7, 6)])
    assert calls == [1, 1], "once per new shape"
