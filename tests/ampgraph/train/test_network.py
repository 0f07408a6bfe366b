"""ampgraph/train/network.py: what build_train_step is given (the network it calls, the
compiled module whose configuration it uses, the parameters it unscales, its group)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampgraph
from ampgraph.module import AmpModule
from ampgraph.train.network import (
    DEFAULT_DTYPE,
    DEFAULT_LEVEL,
    amp_of,
    check_compiled_matches,
    distributed_group,
    is_sharded,
    plain,
    resolve_network,
    train_params,
)


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_an_uncompiled_model_is_compiled_once_with_the_given_options():
    model = mlp()
    network, amp = resolve_network(model, DEFAULT_LEVEL, "bf16", {"keep_io_types": True})
    assert network is amp and isinstance(amp, AmpModule)
    assert amp.amp_config.amp_level == "O2" and amp.amp_dtype == torch.bfloat16


def test_a_compiled_model_is_used_as_it_is_and_refuses_compile_options():
    net = ampgraph.compile(mlp(), "O1", "bf16")
    assert resolve_network(net, DEFAULT_LEVEL, DEFAULT_DTYPE, {}) == (net, net)
    with pytest.raises(ValueError, match=r"already compiled .* cannot apply \['keep_io_types'\]"):
        resolve_network(net, DEFAULT_LEVEL, DEFAULT_DTYPE, {"keep_io_types": False})


def test_a_level_or_dtype_other_than_the_compiled_one_is_refused():
    net = ampgraph.compile(mlp(), "O2", "bf16")
    check_compiled_matches(net, "o2", "bf16")  # the same, spelled otherwise
    check_compiled_matches(net, DEFAULT_LEVEL, DEFAULT_DTYPE)
    with pytest.raises(ValueError, match=r"compiled at amp_level='O2' but build_train_step got "
                                         r"amp_level='O1'"):
        check_compiled_matches(net, "O1", DEFAULT_DTYPE)
    with pytest.raises(ValueError, match=r"compiled with dtype bf16 but build_train_step got "
                                         r"dtype='fp16' \(fp16\)"):
        check_compiled_matches(net, DEFAULT_LEVEL, "fp16")


def test_regionally_compiled_blocks_must_agree():
    model = mlp()
    model[0] = ampgraph.compile(model[0], "O2", "bf16")
    model[2] = ampgraph.compile(model[2], "O2", "bf16")
    network, inner = resolve_network(model, DEFAULT_LEVEL, DEFAULT_DTYPE, {})
    assert network is model and inner is model and amp_of(model) is model[0]
    model[2] = ampgraph.compile(mlp()[2], "O3", "bf16")
    with pytest.raises(ValueError, match="compiled blocks differ"):
        resolve_network(model, DEFAULT_LEVEL, DEFAULT_DTYPE, {})


def test_what_is_not_a_module_or_a_ddp_of_an_uncompiled_one_is_refused():
    with pytest.raises(ValueError, match="must be an nn.Module, got int"):
        resolve_network(3, DEFAULT_LEVEL, DEFAULT_DTYPE, {})


@pytest.mark.filterwarnings("ignore:optimizer contains a parameter group with duplicate")
def test_train_params_are_the_optimizer_s_then_the_model_s_trainable_rest():
    model = mlp()
    first, rest = list(model[0].parameters()), list(model[2].parameters())
    opt = torch.optim.SGD(first + first[:1], lr=0.1)  # a parameter listed twice counts once
    assert train_params(model, opt) == first + rest
    rest[0].requires_grad_(False)
    assert train_params(model, opt) == first + rest[1:]
    with pytest.raises(ValueError, match="optimizer holds none of the model's parameters"):
        train_params(model, torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1))


def test_plain_values_group_and_sharding_outside_distributed_runs():
    assert type(plain(DEFAULT_LEVEL)) is str and plain(DEFAULT_LEVEL) == "O2"
    assert plain(torch.float16) is torch.float16
    assert distributed_group(mlp()) == (False, None)
    assert not is_sharded(list(mlp().parameters()))
