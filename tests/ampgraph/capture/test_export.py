"""ampgraph/capture/export.py: the exported root, dynamic dims and export's guards."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.capture.export import (
    Captured,
    ExportRoot,
    UnsupportedInput,
    check_exportable,
    export_module,
    flatten_inputs,
    share_state,
    signature,
    signature_of,
)


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


# -- the export pieces, directly -------------------------------------------------------------


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.register_buffer("offset", torch.ones(3))

    def forward(self, x, scale=1.0):
        return {"y": self.fc(x) * scale + self.offset, "n": x.shape[0]}


def test_export_module_shares_the_users_parameters_and_keeps_the_batch_dynamic():
    torch.manual_seed(0)
    model = Scaled()
    captured = export_module(model, (torch.randn(2, 4),), {"scale": 2.0})
    gm = captured.gm
    assert gm.get_submodule("fc").weight is model.fc.weight
    assert gm.get_buffer("offset") is model.offset
    ((batch, _),) = captured.dims
    assert isinstance(batch, tuple) and batch[1:] == (2, float("inf"))  # (symbol, lo, hi)
    x = torch.randn(5, 4)
    assert captured.accepts_leaves([x, 2.0])
    assert not captured.accepts_leaves([torch.randn(5, 5), 2.0])  # export's guards: 4 features
    assert not captured.accepts_leaves([torch.randn(1, 4), 2.0])  # 0/1 specialised: from 2
    out = captured.rebuild(gm((x,), {"scale": 2.0}), (x,), {"scale": 2.0})
    torch.testing.assert_close(out["y"], model(x, scale=2.0)["y"])
    assert out["n"] == 5 and not captured.uses_inputs


def test_accepts_leaves_checks_ranks_static_sizes_and_shared_symbols():
    captured = Captured(gm=None, out_spec=("C", None),
                        dims=[(("s0", 2, 10), 4), (("s0", 2, 10),)])
    assert captured.accepts_leaves([torch.ones(3, 4), torch.ones(3)])
    assert not captured.accepts_leaves([torch.ones(3, 4), torch.ones(5)])  # s0 bound to 3
    assert not captured.accepts_leaves([torch.ones(3, 5), torch.ones(3)])  # static 4
    assert not captured.accepts_leaves([torch.ones(11, 4), torch.ones(11)])  # above the range
    assert not captured.accepts_leaves([torch.ones(3, 4)])  # one tensor fewer
    assert not captured.accepts_leaves([torch.ones(3, 4, 1), torch.ones(3)])  # rank


def test_share_state_makes_the_root_see_the_same_dicts():
    model = Scaled().eval()
    root = ExportRoot(model)
    assert root._parameters is model._parameters and root._modules is model._modules
    assert root._buffers is model._buffers and root.training is False
    assert [p for p in root.parameters()] == [p for p in model.parameters()]
    other = nn.Module()
    share_state(other, model)
    assert other.fc is model.fc


def test_signature_keys_on_structure_dtypes_ranks_and_constants():
    x = torch.randn(2, 4)
    assert signature((x,), {}) == signature((torch.randn(7, 4),), {})  # sizes are not in it
    assert signature((x,), {}) != signature((x.double(),), {})
    assert signature((x,), {}) != signature((x[0],), {})
    assert signature((x,), {"scale": 2.0}) != signature((x,), {"scale": 3.0})
    assert signature((x,), {}) != signature((x, x), {})
    hash(signature((x,), {"opts": [1, 2]}))  # an unhashable constant is keyed by identity
    leaves, spec = flatten_inputs((x, x), {})
    assert leaves == [x, x] and signature_of(leaves, spec) == signature((x, x), {})
    assert flatten_inputs((x, x), {})[1] is spec  # the spec of n positional tensors is kept


class TakesShape(nn.Module):
    """Arguments torch.export takes with no ``dynamic_shapes`` (a size) or not at all."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x, shape, dtype=None, device=None):
        assert type(shape) is torch.Size and isinstance(dtype, torch.dtype), "as the caller gave"
        return self.fc(x).reshape(shape).to(dtype=dtype, device=device)


def test_a_size_and_constants_export_refuses_are_given_back_to_the_model():
    model = TakesShape()
    x = torch.randn(6, 4)
    kwargs = {"dtype": torch.float64, "device": torch.device("cpu")}
    captured = export_module(model, (x, torch.Size([2, 3, 4])), kwargs)
    assert len(captured.dims) == 1, "the size's ints and the constants are not tensor inputs"
    y = torch.randn(6, 4)
    out = captured.rebuild(captured.gm((y, torch.Size([2, 3, 4])), kwargs), (y,), kwargs)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, model(y, torch.Size([2, 3, 4]), **kwargs))
    assert signature((x, torch.Size([2, 3, 4])), kwargs) \
        != signature((x, torch.Size([3, 2, 4])), kwargs), "the size's ints key the graph"
    assert signature((x, torch.Size([2, 3, 4])), kwargs) \
        != signature((x, torch.Size([2, 3, 4])), {**kwargs, "dtype": torch.float16})


class Registry(collections.UserDict):
    """An unregistered mapping the model writes into (as transformers' KVSharingDict)."""


def test_an_input_export_cannot_take_is_named_before_export_is_tried():
    check_exportable((torch.ones(2), None, True, 1, 2.0, "s", nn.Linear(1, 1)), {"k": [None]})
    with pytest.raises(UnsupportedInput, match=r"argument `shared` is a .*\.Registry, which "
                                                 r"torch.export cannot take"):
        check_exportable((torch.ones(2),), {"shared": Registry()})
    with pytest.raises(UnsupportedInput, match="argument 1 is a builtins.function"):
        check_exportable((torch.ones(2), [lambda: 0]), {})
    with pytest.raises(UnsupportedInput, match="argument 0 is a"):
        export_module(Scaled(), (Registry(),), {})


