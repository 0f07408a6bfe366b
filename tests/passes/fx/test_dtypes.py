"""passes/fx/dtypes.py: the dtype metadata a rewritten node carries."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import fx

from passes.fx.dtypes import (
    CAST,
    dtype_of,
    float_dtypes,
    is_amp_cast,
    is_widening,
    orig_dtype,
    set_dtype,
)
from passes.fx.nodes import FLOATS, tensors
from tests.helpers import make
from tests.passes.fx.helpers import check_pass


def node_with(val, **meta) -> fx.Node:
    g = fx.Graph()
    node = g.placeholder("x")
    node.meta.update(val=val, **meta)
    return node


def test_dtype_of_reads_the_tracked_dtype_before_the_captured_value():
    f32, f16 = torch.empty(2), torch.empty(2, dtype=torch.float16)
    assert dtype_of(node_with(f32)) == torch.float32
    assert dtype_of(node_with(f32, amp_dtype=torch.bfloat16)) == torch.bfloat16
    assert dtype_of(node_with((f16,))) == torch.float16, "a single tensor in a tuple"
    assert dtype_of(node_with((f16, f32))) is None, "two tensors: no single dtype"
    assert dtype_of(node_with(3)) is None and dtype_of(node_with(None)) is None
    assert dtype_of(torch.float32) is None and dtype_of(None) is None, "not a node"
    node = node_with(f32)
    set_dtype(node, None)
    assert "amp_dtype" not in node.meta
    set_dtype(node, torch.float16)
    assert dtype_of(node) == torch.float16
    assert orig_dtype(node) == torch.float16, "no captured dtype recorded: the current one"
    node.meta["amp_orig_dtype"] = torch.float32
    assert orig_dtype(node) == torch.float32


def test_is_amp_cast_only_for_marked_nodes():
    g = fx.Graph()
    x = g.placeholder("x")
    ours = g.call_function(CAST, (x,), {"dtype": torch.float16})
    users = g.call_function(CAST, (x,), {"dtype": torch.float16})
    ours.meta["amp_cast"] = True
    assert is_amp_cast(ours) and not is_amp_cast(users) and not is_amp_cast(x)
    assert not is_amp_cast("a string") and not is_amp_cast(None)


def test_float_dtypes_of_meta_values_are_shared_sets():
    f16, i64 = torch.empty(1, dtype=torch.float16), torch.empty(1, dtype=torch.int64)
    assert float_dtypes(f16) == {torch.float16}
    assert float_dtypes(f16) is float_dtypes(torch.empty(3, dtype=torch.float16))
    assert float_dtypes(i64) == frozenset()
    assert float_dtypes((f16, [i64, torch.empty(1)])) == {torch.float16, torch.float32}
    assert float_dtypes(None) == frozenset()


def test_widening_is_low_to_fp32_only():
    assert is_widening(torch.bfloat16, torch.float32) and is_widening(torch.float16, torch.float32)
    assert not is_widening(torch.float32, torch.float32)
    assert not is_widening(torch.float16, torch.bfloat16) and not is_widening(torch.float16, None)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_tracked_dtypes_after_the_pipeline(level, dtype):
    """Structure, invariants and numerics (check_pass), then the metadata: every cast holds
    the dtype it casts to, outputs are back in their captured dtype (keep_io_types), and
    every float value is one of the three float dtypes."""
    model, inputs = make("lenet5")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm, _ = check_pass(model, inputs, level, dtype)
    for node in gm.graph.nodes:
        if is_amp_cast(node):
            assert dtype_of(node) == node.kwargs["dtype"], node
        elif node.op == "output":
            for out in node.all_input_nodes:
                assert dtype_of(out) == orig_dtype(out) == torch.float32, out
        elif any(t.is_floating_point() for t in tensors(node.meta.get("val"))) \
                and dtype_of(node) is not None:
            assert dtype_of(node) in FLOATS, node
    assert any(dtype_of(n) == dtype for n in gm.graph.nodes)
