"""ampgraph/capture/loss_only.py: calls that read only the loss get graphs of their own,
which drop the logits; the head_loss mode each capture runs."""

from __future__ import annotations

import threading

import torch
from torch import nn

import ampgraph
from ampgraph.capture.loss_only import graph_mode, head_loss_for, loss_only, wants_loss_only


def test_the_mark_is_scoped_to_the_body_and_to_its_thread():
    seen = []
    with loss_only():
        assert wants_loss_only() and graph_mode(True) == (True, "loss only")
        t = threading.Thread(target=lambda: seen.append(wants_loss_only()))
        t.start()
        t.join()
    assert seen == [False] and not wants_loss_only() and graph_mode(False) is False


def test_head_loss_modes_per_capture():
    assert head_loss_for("auto", True) == "auto"
    assert head_loss_for("drop_logits", True) == "drop_logits"
    assert head_loss_for("drop_logits", False) == "auto"  # evaluation keeps the logits
    with loss_only():
        assert head_loss_for("auto", False) == "drop_logits"
        assert head_loss_for("off", True) == "off"


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 50)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        logits = self.head(torch.relu(self.body(x)))
        return {"loss": nn.functional.cross_entropy(logits, y), "logits": logits}


def test_loss_only_calls_drop_the_logits_in_a_graph_of_their_own():
    torch.manual_seed(0)
    net = ampgraph.compile(Head(), "O2", "bf16")
    x, y = torch.randn(6, 8), torch.randint(0, 50, (6,))
    full = net(x, y)
    with loss_only():
        lean = net(x, y)
    again = net(x, y)
    assert full["logits"].shape == (6, 50) and lean["logits"] is None
    assert again["logits"] is not None
    assert torch.allclose(lean["loss"], full["loss"], rtol=1e-3)
    assert len(net._amp_graphs) == 2  # (train, signature) and ((train, "loss only"), ...)
