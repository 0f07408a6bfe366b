"""passes/fx/propagate.py: the fast dtype paths give what running every op gives."""

from __future__ import annotations

import pytest
import torch

import passes.fx.propagate as casts  # (the module was passes.fx.casts)
from passes.fx.dataflow import build_dataflow
from passes.fx.dtypes import dtype_of
from passes.fx.insert_casts import annotate, insert_casts
from passes.fx.nodes import op_key
from passes.fx.policy import make_policy
from passes.fx.prepare import prepare
from passes.paint import paint
from tests.helpers import make
from tests.passes.fx.helpers import blocks, dtype_blocks, export, meta_of, one_dtype_blocks


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["resnet", "unet", "bert_encoder", "gpt_decoder"])
def test_fast_dtype_tracking_agrees_with_fake_tensor_execution(name, level):
    from passes.fx.dataflow import build_dataflow
    from passes.fx.dtypes import dtype_of
    from passes.fx.insert_casts import annotate, insert_casts
    from passes.fx.prepare import prepare
    from passes.paint import paint

    model, inputs = make(name)
    graphs = []
    for exact in (False, True):
        gm = export(model, inputs)
        prepare(gm)
        annotate(gm, paint(build_dataflow(gm), make_policy(level)))
        insert_casts(gm, torch.bfloat16, exact=exact)
        graphs.append({n.name: dtype_of(n) for n in gm.graph.nodes})
    assert graphs[0] == graphs[1]


@pytest.mark.parametrize("build", [blocks, dtype_blocks, one_dtype_blocks])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_remembered_runs_agree_with_running_every_op(level, low, build):
    """Repeated multi-output ops take the remembered result: the dtypes of every node, and
    the values of the multi-output ones, are those running every op gives. (Single-output
    ops that follow their inputs only record ``amp_dtype``: their ``val`` keeps the captured
    dtype either way.)"""
    seen = []
    for exact in (False, True):
        gm = build(6)
        prepare(gm)
        annotate(gm, paint(build_dataflow(gm), make_policy(level)))
        insert_casts(gm, low, exact=exact)
        seen.append({n.name: (dtype_of(n), meta_of(n.meta["val"])
                              if isinstance(n.meta.get("val"), tuple) else None)
                     for n in gm.graph.nodes})
    assert seen[0] == seen[1]
    assert sum(isinstance(v[1], tuple) for v in seen[0].values()) == 6


_REAL_RUN = casts.DtypeTracker._run


def count_runs(monkeypatch, gm, level="O2"):
    runs = []
    real = _REAL_RUN

    def run(self, node):
        runs.append(op_key(node))
        return real(self, node)

    monkeypatch.setattr(casts.DtypeTracker, "_run", run)
    prepare(gm)
    annotate(gm, paint(build_dataflow(gm), make_policy(level)))
    insert_casts(gm, torch.bfloat16)
    return runs


def test_norms_reading_their_captured_inputs_are_not_rerun(monkeypatch):
    """At O2 every fp32 layer norm reads a copy widened back to its captured dtype: its
    captured value still holds, so no layer norm runs, however many there are."""
    def kernels(gm):  # getitem has no kernel: it always runs, to pick its element
        return [r for r in count_runs(monkeypatch, gm, "O2") if r != "getitem"]

    assert kernels(blocks(3)) == kernels(blocks(30)) == []


class _Sequencer(torch.nn.Module):
    """An LSTM across an image's rows, as timm's Sequencer2d runs it: batch first,
    bidirectional, over a batch whose size is a product of symbolic sizes (B * H)."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(8, 16)
        self.rnn = torch.nn.LSTM(16, 12, num_layers=2, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, h, w, _ = x.shape
        y, _ = self.rnn(self.embed(x).reshape(b * h, w, -1))
        return self.head(y.reshape(b, h, w, -1))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_an_lstm_on_symbolic_sizes_is_captured_whole_in_low_precision(mode, one_thread):
    """aten.lstm.input's C++ kernel calls numel(), which symbolic sizes refuse: re-running
    it on the new dtypes goes through torch's Python decomposition, as export traced it. The
    model is one graph, the LSTM in bf16 as under CPU autocast (mkldnn_rnn_layer), and its
    outputs and gradients agree with fp32's."""
    import copy
    import warnings

    import ampgraph

    torch.manual_seed(0)
    model = _Sequencer()
    x = torch.randn(2, 3, 7, 8)
    net = ampgraph.compile(copy.deepcopy(model), amp_level="O2", dtype="bf16")
    getattr(net, mode)()
    getattr(model, mode)()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # export's note on nn.LSTM's _flat_weights
        out = net(x)
    graphs, eager = net.amp_parts()
    assert eager == [] and len(graphs) == 1
    rows = {r["name"]: r for r in ampgraph.explain(net).nodes}
    assert rows["lstm"]["precision"] == "bf16"
    ref = model(x)
    assert out.dtype == torch.float32 and _cos(out, ref) > 0.9999
    if mode == "train":
        out.square().mean().backward()
        ref.square().mean().backward()
        grads = [torch.cat([p.grad.flatten() for p in m.parameters()]) for m in (net, model)]
        assert _cos(*grads) > 0.9999
