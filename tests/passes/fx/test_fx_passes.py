"""FX passes: structure, invariants and numerics in one helper, over levels and dtypes."""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn

from passes import PassError
from passes.fx import fold_casts, run_amp_passes, verify
from passes.fx.dtypes import CAST, is_amp_cast
from passes.fx.fold import count_casts
from passes.policy import make_policy
from tests.helpers import cosine, first_tensor, make


def export(model, inputs):
    return torch.export.export(model, inputs, strict=False).module()


def check_pass(model, inputs, level, dtype):
    """Structure, invariants and numerics of the FX pipeline on one model."""
    model.eval()
    with torch.no_grad():
        expected = first_tensor(model(*inputs))
    gm = export(model, inputs)
    result = run_amp_passes(gm, make_policy(level), dtype)
    casts = [n for n in gm.graph.nodes if is_amp_cast(n)]
    # structure: one cast per (producer, dtype); parameter casts hoisted; counts agree
    keys = collections.Counter((n.args[0], n.kwargs["dtype"]) for n in casts)
    assert all(v == 1 for v in keys.values()), keys
    assert result.casts == len(casts) == count_casts(gm)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    first_op = min((order[n] for n in gm.graph.nodes
                    if n.op == "call_function" and not is_amp_cast(n)), default=0)
    for c in casts:
        if c.args[0].op == "get_attr":
            assert order[c] < first_op, f"{c} not hoisted"
        src = c.args[0]
        if is_amp_cast(src):  # only fp32 -> low -> fp32 may chain (it changes values)
            assert src.args[0].meta["val"].dtype == torch.float32
    if level == "O0":
        assert not casts
    # invariants: lint, verify, idempotence
    gm.graph.lint()
    verify(gm, dtype)
    again = run_amp_passes(gm, make_policy(level), dtype)
    assert again.casts == result.casts, "a second run must add no casts"
    # numerics
    with torch.no_grad():
        got = first_tensor(gm(*inputs))
    assert got.dtype == torch.float32
    tol = 0.999 if level != "O0" else 1.0 - 1e-6
    assert cosine(got, expected) >= tol
    return gm, result


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["lenet5", "resnet", "bert_encoder"])
def test_pipeline_on_reference_models(name, level, dtype):
    model, inputs = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_pass(model, inputs, level, dtype)


class TwoConsumers(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)

    def forward(self, x):
        h = self.a(x)
        return self.b(h) + self.b(h * 2), self.norm(h)


def test_one_cast_per_producer_shared_by_consumers():
    model = TwoConsumers()
    x = torch.randn(3, 4)
    gm, _ = check_pass(model, (x,), "O2", torch.bfloat16)
    casts_of_x = [n for n in gm.graph.nodes if is_amp_cast(n) and n.args[0].op == "placeholder"]
    assert len(casts_of_x) == 1, "a graph input with several low consumers is cast once"
    b_weight_casts = [n for n in gm.graph.nodes if is_amp_cast(n)
                      and n.args[0].op == "get_attr" and n.args[0].target == "b.weight"]
    assert len(b_weight_casts) == 1, "a weight used twice is cast once per forward"
    # h feeds bf16 (b, mul) and fp32 (layer_norm) consumers: one cast to fp32, shared
    linear_a = next(n for n in gm.graph.nodes if n.name == "linear")
    assert [u.kwargs.get("dtype") for u in linear_a.users if is_amp_cast(u)] == [torch.float32]


def _graph_with_chain(first, second, src_dtype):
    g = torch.fx.Graph()
    x = g.placeholder("x")
    c1 = g.call_function(CAST, (x,), {"dtype": first})
    c2 = g.call_function(CAST, (c1,), {"dtype": second})
    g.output(g.call_function(torch.ops.aten.relu.default, (c2,)))
    gm = torch.fx.GraphModule(nn.Module(), g)
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    with mode:
        x.meta["val"] = torch.empty(2, dtype=src_dtype)
        c1.meta["val"] = torch.empty(2, dtype=first)
        c2.meta["val"] = torch.empty(2, dtype=second)
    for c in (c1, c2):
        c.meta["amp_cast"] = True
    return gm


def test_fold_low_fp32_low_chain_but_keep_fp32_low_fp32():
    gm = _graph_with_chain(torch.float32, torch.float16, torch.float16)
    assert fold_casts(gm).modified
    assert count_casts(gm) == 0, "fp16 -> fp32 -> fp16 is the identity"
    x = torch.randn(2).half()
    torch.testing.assert_close(gm(x), x.relu())

    gm = _graph_with_chain(torch.bfloat16, torch.float32, torch.float32)
    fold_casts(gm)
    assert count_casts(gm) == 2, "fp32 -> bf16 -> fp32 rounds: never folded"
    x = torch.tensor([1.0 + 2**-12, 3.0])
    assert gm(x)[0].item() != x[0].item()


def test_verify_names_the_node_that_breaks_the_contract():
    model = TwoConsumers()
    gm = export(model, (torch.randn(2, 4),))
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    norm = next(n for n in gm.graph.nodes if str(n.target).startswith("aten.layer_norm"))
    cast = norm.args[0]
    norm.replace_input_with(cast, cast.args[0])  # feed bf16 to the fp32 layer_norm
    with pytest.raises(PassError, match="layer_norm") as info:
        verify(gm, torch.bfloat16)
    assert info.value.pass_name == "verify"


def test_inplace_activation_becomes_functional_and_runs_low():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2))
    gm, _ = check_pass(model, (torch.randn(3, 4),), "O1", torch.bfloat16)
    ops = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "aten.relu.default" in ops and "aten.relu_.default" not in ops


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
@pytest.mark.parametrize("name", ["resnet", "unet", "bert_encoder", "gpt_decoder"])
def test_fast_dtype_tracking_agrees_with_fake_tensor_execution(name, level):
    from passes.fx.dtypes import dtype_of
    from passes.fx.graph import build_dataflow, prepare
    from passes.fx.insert_casts import annotate, insert_casts
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
