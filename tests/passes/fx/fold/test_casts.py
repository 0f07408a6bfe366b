"""passes/fx/fold/casts.py: cast chains fold where values allow, counts agree."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from passes.fx.dtypes import CAST, dtype_of, is_amp_cast, is_widening
from passes.fx.fold.cast_count import count_casts
from passes.fx.fold.casts import fold_casts
from passes.fx.verify import verify
from tests.helpers import make
from tests.passes.fx.helpers import check_pass


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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["resnet", "bert_encoder"])
def test_no_foldable_chain_is_left_and_folding_again_changes_nothing(name, dtype):
    model, inputs = make(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm, result = check_pass(model, inputs, "O2", dtype)
    for cast in (n for n in gm.graph.nodes if is_amp_cast(n) and n.target is CAST):
        src, target = cast.args[0], cast.kwargs["dtype"]
        assert dtype_of(src) != target, f"{cast}: a cast to its source's own dtype"
        if is_amp_cast(src):
            assert not (dtype_of(src.args[0]) == target and is_widening(target, dtype_of(src))), \
                f"{cast}: low -> fp32 -> low left"
    with torch.no_grad():
        before = gm(*inputs)
    assert not fold_casts(gm).modified
    assert count_casts(gm) == result.casts
    gm.graph.lint()
    verify(gm, dtype)
    with torch.no_grad():
        torch.testing.assert_close(gm(*inputs), before, rtol=0, atol=0)
