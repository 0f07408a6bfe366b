"""Models that cannot be exported whole fall back per submodule, and say so."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from tests.helpers import MATMUL_OPS, Keyworded, cosine, record


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return self.norm(torch.relu(self.fc(x)) + x)


class DataDependent(nn.Module):
    """The number of blocks run depends on the input's values: not exportable."""

    def __init__(self, d=16):
        super().__init__()
        self.embed = nn.Linear(8, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(3))
        self.head = nn.Linear(d, 4)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            if h.abs().mean() > 10:  # data-dependent Python control flow
                break
            h = block(h)
        return self.head(h)


def test_data_dependent_model_compiles_matches_fp32_and_explain_names_eager_part():
    torch.manual_seed(0)
    model = DataDependent().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(5, 8)
    with pytest.warns(UserWarning, match="could not be captured whole"):
        with torch.no_grad():
            out, rec = record(lambda: net(x))
    with torch.no_grad():
        ref = model(x)
    assert out.dtype == torch.float32
    assert cosine(out, ref) >= 0.999
    assert {d[0] for _, d in rec.inputs_of(MATMUL_OPS)} == {torch.bfloat16}, \
        "the submodules still run their matmuls in bf16"
    report = ampgraph.explain(net)
    eager = {e.path: e for e in report.eager}
    assert "<root>" in eager and "export failed" in eager["<root>"].reason
    assert "DataDependent" == eager["<root>"].module_type
    modules = {r["module"] for r in report.nodes}
    assert {"embed", "head", "blocks.0.fc", "blocks.2.norm"} <= modules
    assert "EAGER" in str(report)
    # batch size changes and training still work
    net.train()
    y = net(torch.randn(3, 8))
    y.sum().backward()
    assert model.head.weight.grad is not None


# -- what trainers see: autocast around the call ------------------------------------------


def test_autocast_outside_does_not_recast_the_graph():
    """Accelerate / Lightning / the HF Trainer may wrap forward in autocast: the graph's
    fp32 ops (the norm) stay fp32, the linear runs bf16 (the graph's cast, not autocast's),
    and the caller's autocast state is back on afterwards."""
    torch.manual_seed(0)
    model = Keyworded()
    net = ampgraph.compile(model, "O2", "bf16")
    x = torch.randn(4, 8)
    plain = net(x)
    with torch.autocast("cpu", dtype=torch.float16):
        out, rec = record(lambda: net(x))
        assert torch.is_autocast_enabled("cpu")
    assert torch.float16 not in {dt for _, d in rec.calls for dt in d}  # autocast did nothing
    assert rec.norm_compute_dtypes() == {torch.float32}
    assert rec.first_input_dtypes(MATMUL_OPS) == {torch.bfloat16}
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, plain)
    # captured for the first time under autocast: no autocast op gets into the graph
    fresh = ampgraph.compile(Keyworded(), "O2", "bf16")
    with torch.autocast("cpu", dtype=torch.float16):
        fresh(x)
    assert "torch.float16" not in fresh.amp_parts()[0][0][1].gm.code


def test_the_graph_reads_submodules_as_plain_attributes_and_setattr_still_wins():
    """The generated code's ``getattr(self, "0")...weight`` chains read instance-dict
    entries (nn.Module.__getattr__ costs ~1 us a step); replacing a submodule through
    nn.Module.__setattr__ drops the entry, so the graph reads the new one."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.ReLU())
    net = ampgraph.compile(model, amp_level="O2")
    x = torch.randn(2, 4)
    net(x)
    gm = net._amp_last.captured.gm
    assert gm.__dict__["0"] is gm._modules["0"]
    assert gm.__dict__["0"].__dict__["0"] is gm._modules["0"]._modules["0"]
    inner = nn.Sequential(nn.Linear(4, 4))
    setattr(gm, "0", inner)
    assert "0" not in gm.__dict__
    with torch.no_grad():
        torch.testing.assert_close(gm((x,), {})[0], torch.relu(inner(x)), rtol=2e-2, atol=2e-2)


class Pairs(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).view(x.shape[0] // 2, 2, 4)  # an odd batch fails, eager too


def test_shapes_export_refuses_run_eagerly_alone_and_the_module_stays_compiled(monkeypatch):
    import ampgraph.module as module

    exports = []
    real = module.export_module
    monkeypatch.setattr(module, "export_module", lambda *a: exports.append(1) or real(*a))
    net = ampgraph.compile(Pairs(), amp_level="O2")
    net(torch.randn(4, 4))
    with pytest.warns(UserWarning, match="these input shapes"), \
            pytest.raises(RuntimeError, match="invalid for input of size"):
        net(torch.randn(3, 4))  # the model's own error, as eager
    with pytest.raises(RuntimeError, match="invalid for input of size"):
        net(torch.randn(3, 4))
    assert len(exports) == 2, "the refused shapes are remembered, not exported again"
    assert net._amp_eager is None
    assert net(torch.randn(6, 4)).shape == (3, 2, 4) and len(exports) == 2


def test_a_graph_transform_that_adds_submodules_refreshes_the_attribute_shortcuts():
    torch.manual_seed(0)
    net = ampgraph.compile(nn.Sequential(nn.Sequential(nn.Linear(4, 4)), nn.ReLU()),
                           amp_level="O2")
    x = torch.randn(2, 4)
    net(x)
    zero = nn.Linear(4, 4)
    with torch.no_grad():
        zero.weight.zero_()
        zero.bias.fill_(1.0)
    net.add_graph_transform(lambda gm: gm.add_submodule("0.0", zero))
    with torch.no_grad():
        torch.testing.assert_close(net(x), torch.ones(2, 4))


class WritesAView(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h[:, :].relu_()  # export keeps an in-place write through a view in place
        return self.fc2(h), h


def test_a_cast_read_after_an_in_place_write_sees_the_written_value():
    """The output cast of ``h`` sat right after ``h``'s producer, before the write: the
    returned ``h`` kept its negative values (found by review; older than this check)."""
    torch.manual_seed(0)
    model = WritesAView()
    net = ampgraph.compile(model, amp_level="O2")
    x = torch.randn(8, 4)
    with torch.no_grad():
        (y, h), (ry, rh) = net(x), model(x)
    assert h.min() >= 0
    torch.testing.assert_close(h, rh, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(y, ry, rtol=2e-2, atol=2e-2)
