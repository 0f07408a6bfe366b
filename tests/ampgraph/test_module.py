"""Models that cannot be exported whole fall back per submodule, and say so."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampgraph
from tests.helpers import MATMUL_OPS, Keyworded, record

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


def test_shapes_the_eager_model_rejects_raise_its_error_and_the_module_stays_compiled(
        monkeypatch):
    import ampgraph.capture.cache as cache

    exports = []
    real = cache.export_module
    monkeypatch.setattr(cache, "export_module", lambda *a: exports.append(1) or real(*a))
    net = ampgraph.compile(Pairs(), amp_level="O2")
    net(torch.randn(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the user's error: no warning, no fallback
        with pytest.raises(RuntimeError, match="invalid for input of size"):
            net(torch.randn(3, 4))  # the model's own error, as eager
    assert net._amp_eager is None and not net._amp_cache.refused
    assert net(torch.randn(6, 4)).shape == (3, 2, 4) and len(exports) == 2


def test_shapes_only_export_refuses_run_eagerly_alone_and_are_remembered(monkeypatch):
    import ampgraph.capture.cache as cache

    class EvenOnly(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.shape[0] % 2 and x.sum() > 0:  # odd sizes branch on data: export refuses
                return self.fc(x) * 2
            return self.fc(x)

    exports = []
    real = cache.export_module
    monkeypatch.setattr(cache, "export_module", lambda *a: exports.append(1) or real(*a))
    net = ampgraph.compile(EvenOnly(), amp_level="O2")
    net(torch.randn(4, 4))
    with pytest.warns(UserWarning, match="these input shapes"):
        net(torch.ones(3, 4))
    net(torch.ones(3, 4))
    assert len(exports) == 2, "the refused shapes are remembered, not exported again"
    assert net._amp_eager is None


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


def test_the_state_is_declared_and_the_model_and_eager_plan_are_not_children():
    """Every field the class declares is set by __init__; the user's model and the eager
    plan are modules kept beside the shared dicts, never registered in them."""
    from ampgraph.module import AmpModule

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    keys = list(model.state_dict())
    net = ampgraph.compile(model, "O2", "bf16")
    declared = set(AmpModule.__annotations__) - {"_amp_training"}
    assert declared <= set(vars(net)), declared - set(vars(net))
    assert net.original_module is model and net._amp_eager is None
    assert list(net._modules) == ["0", "1"] and net._modules is model._modules
    assert list(net.state_dict()) == list(model.state_dict()) == keys

    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(4, 4)

        def forward(self, x):
            return self.inner(x) if x.sum() > 0 else -self.inner(x)

    branchy = Branchy()
    net = ampgraph.compile(branchy, "O2", "bf16")
    with pytest.warns(UserWarning, match="could not be captured whole"):
        net(torch.ones(2, 4))
    assert net._amp_eager is not None and net._amp_eager.inner is not branchy.inner
    assert list(branchy._modules) == ["inner"] and list(net.state_dict()) == [
        "inner.weight", "inner.bias"]
    assert [m for m in net.modules() if m is net._amp_eager] == []


def test_amp_module_of_a_model_is_an_instance_of_its_compiled_class():
    """AmpModule(model) picks the model class's compiled class; deepcopy and copy keep it,
    and a subclass of AmpModule is left as it is."""
    import copy

    from ampgraph.compiled_class import compiled_class
    from ampgraph.module import AmpModule

    model = Keyworded()
    resolved = ampgraph.AmpConfig.create(amp_level="O2", dtype="bf16").resolve(
        torch.device("cpu"))
    net = AmpModule(model, resolved)
    assert type(net) is compiled_class(AmpModule, Keyworded) and isinstance(net, AmpModule)
    assert type(AmpModule(model=Keyworded(), config=resolved)) is type(net)
    x = torch.randn(2, 8)
    twin = copy.deepcopy(net)
    assert type(twin) is type(net) and twin.original_module is not model
    torch.testing.assert_close(twin(x), net(x))
    assert type(copy.copy(net)) is type(net)

    class Mine(AmpModule):
        pass

    assert type(Mine(Keyworded(), resolved)) is Mine


class Branchy(nn.Module):
    """Data-dependent control flow: export refuses it whole, its Linear compiles alone."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(4, 4)

    def forward(self, x):
        return self.inner(x) if x.sum() > 0 else -self.inner(x)


def test_compiled_for_gives_the_graph_a_call_runs_and_none_when_eager(monkeypatch):
    import ampgraph.capture.cache as cache

    exports = []
    real = cache.export_module
    monkeypatch.setattr(cache, "export_module", lambda *a: exports.append(1) or real(*a))
    net = ampgraph.compile(nn.Sequential(nn.Linear(4, 4)), "O2", "bf16")
    x = torch.randn(2, 4)
    compiled = net.compiled_for((x,), {})
    assert compiled is not None and len(exports) == 1
    assert net.compiled_for((torch.randn(2, 4),), {}) is compiled and len(exports) == 1
    net(x)
    assert net.amp_parts()[0] == [("", compiled)]
    eager = ampgraph.compile(Branchy(), "O2", "bf16")
    with pytest.warns(UserWarning, match="could not be captured whole"):
        assert eager.compiled_for((torch.ones(2, 4),), {}) is None


def test_drop_graphs_makes_the_next_call_capture_again_children_too(monkeypatch):
    import ampgraph.capture.cache as cache
    import ampgraph.module as module

    exports = []
    real = cache.export_module
    monkeypatch.setattr(cache, "export_module", lambda *a: exports.append(1) or real(*a))
    net = ampgraph.compile(nn.Sequential(nn.Linear(4, 4)), "O2", "bf16")
    x = torch.randn(2, 4)
    first = net.compiled_for((x,), {})
    net.drop_graphs()
    assert net.compiled_for((x,), {}) is not first and len(exports) == 2
    eager = ampgraph.compile(Branchy(), "O2", "bf16")
    with pytest.warns(UserWarning, match="could not be captured whole"):
        eager(torch.ones(2, 4))
    (child,) = [m for m in eager._amp_eager.modules() if isinstance(m, module.AmpModule)]
    assert len(child._amp_graphs) == 1
    eager.drop_graphs()
    assert len(child._amp_graphs) == 0
    eager(torch.ones(2, 4))
    assert len(child._amp_graphs) == 1
