"""Bad input gets a clear error that names the fix."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph


@pytest.mark.parametrize("level", ["O4", "o5", "", None, 2])
def test_unknown_level(level):
    with pytest.raises(ValueError, match="O0, O1, O2, O3"):
        ampgraph.compile(nn.Linear(2, 2), amp_level=level)


def test_level_is_case_insensitive():
    assert ampgraph.compile(nn.Linear(2, 2), amp_level="o2").amp_config.amp_level == "O2"


@pytest.mark.parametrize("obj", ["model", 3, lambda x: x, None])
def test_non_module(obj):
    with pytest.raises(TypeError, match="torch.nn.Module"):
        ampgraph.compile(obj)


@pytest.mark.parametrize("dtype", ["fp8", "float32", "int8", torch.float32, torch.int8, 16])
def test_unknown_dtype(dtype):
    with pytest.raises(ValueError, match="auto, bf16, fp16"):
        ampgraph.compile(nn.Linear(2, 2), dtype=dtype)


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "bfloat16", "float16", "torch.bfloat16",
                                   torch.bfloat16, torch.float16, "auto", "BF16"])
def test_accepted_dtypes(dtype, recwarn):
    net = ampgraph.compile(nn.Linear(2, 2), dtype=dtype)
    assert net.amp_dtype in (torch.bfloat16, torch.float16)


def test_auto_is_bf16_on_cpu():
    assert ampgraph.compile(nn.Linear(2, 2)).amp_dtype == torch.bfloat16


def test_fp16_on_cpu_without_fp16_arithmetic_warns():
    from ampgraph.config import cpu_has_fast_fp16

    if cpu_has_fast_fp16():
        pytest.skip("this CPU has fp16 arithmetic")
    with pytest.warns(RuntimeWarning, match="hundreds of times slower"):
        ampgraph.compile(nn.Linear(2, 2), dtype="fp16")


def test_bad_override_values():
    with pytest.raises(ValueError, match="fp32, bf16, fp16 or low"):
        ampgraph.compile(nn.Linear(2, 2), module_overrides={"x": "int8"})
    with pytest.raises(TypeError, match="module_overrides"):
        ampgraph.compile(nn.Linear(2, 2), module_overrides=["x"])
    with pytest.raises(TypeError, match="custom_allow"):
        ampgraph.compile(nn.Linear(2, 2), custom_allow=[3])
    with pytest.raises(TypeError, match="nn.Module subclass"):
        ampgraph.compile(nn.Linear(2, 2), custom_deny=[int])


def test_model_on_meta_device():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="meta device.*to_empty"):
        ampgraph.compile(model)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_model_already_in_half_precision(dtype):
    with pytest.raises(ValueError, match=r"fp32 master weights.*model.float\(\)"):
        ampgraph.compile(nn.Linear(4, 4).to(dtype))


def test_model_with_no_float_ops_warns_and_runs():
    class Ints(nn.Module):
        def forward(self, ids):
            return ids * 2 + 1

    net = ampgraph.compile(Ints(), "O2", "bf16")
    with pytest.warns(UserWarning, match="no floating-point ops"):
        out = net(torch.arange(4))
    assert torch.equal(out, torch.arange(4) * 2 + 1)
