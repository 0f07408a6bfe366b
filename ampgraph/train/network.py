"""What ``build_train_step`` is given: the network it calls, the compiled module whose
configuration it uses (a whole-model AmpModule or regionally compiled blocks), the
parameters it unscales, and the process group it agrees with."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ampgraph.api import compile as compile_model
from ampgraph.config import dtype_name, model_device
from ampgraph.module import AmpModule


class ArgDefault(str):
    """A default argument value that can be told apart from the same value passed explicitly."""


DEFAULT_LEVEL = ArgDefault("O2")
DEFAULT_DTYPE = ArgDefault("auto")


def resolve_network(
    model: nn.Module, amp_level: str, dtype: Any, compile_kwargs: dict[str, Any]
) -> tuple[nn.Module, nn.Module]:
    """(what the step calls, the AmpModule): compile unless already compiled."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"model must be an nn.Module, got {type(model).__name__}")
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    if isinstance(inner, AmpModule):
        if compile_kwargs:
            raise ValueError(
                f"model is already compiled by ampgraph.compile, so build_train_step cannot "
                f"apply {sorted(compile_kwargs)}: pass them to ampgraph.compile instead"
            )
        check_compiled_matches(inner, amp_level, dtype)
        return model, inner
    regions = [m for m in inner.modules() if isinstance(m, AmpModule)]
    if regions:  # compiled per block ("regional"), e.g. before FSDP2's fully_shard per block
        if compile_kwargs:
            raise ValueError(
                f"model holds modules compiled by ampgraph.compile, so build_train_step cannot "
                f"apply {sorted(compile_kwargs)}: pass them to ampgraph.compile instead"
            )
        amp = amp_of(inner)
        differ = [m for m in regions
                  if (m.amp_config, m.amp_dtype) != (amp.amp_config, amp.amp_dtype)]
        if differ:
            raise ValueError(
                f"the model's compiled blocks differ: {amp!r} vs {differ[0]!r}; compile every "
                "block with the same amp_level, dtype and options"
            )
        check_compiled_matches(amp, amp_level, dtype)
        return model, inner
    if inner is not model:
        raise ValueError(
            "model is a DistributedDataParallel around an uncompiled module: compile first, "
            "then wrap: DistributedDataParallel(ampgraph.compile(model, ...)); "
            "see docs/training.md"
        )
    compiled = compile_model(model, plain(amp_level), plain(dtype), **compile_kwargs)
    return compiled, compiled


def amp_of(module: nn.Module) -> nn.Module:
    """The AmpModule whose configuration a step uses: ``module`` itself, or the first
    compiled block of a regionally compiled model.

    Example:
        >>> amp_of(ampgraph.compile(model)).amp_config.amp_level  # doctest: +SKIP
        'O2'
    """
    return next(m for m in module.modules() if isinstance(m, AmpModule))


def is_sharded(params: list[nn.Parameter]) -> bool:
    """Some parameter is a DTensor (FSDP2's ``fully_shard``)."""
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in params)


def plain(value: Any) -> Any:
    return str.__str__(value) if isinstance(value, str) else value


def check_compiled_matches(module: nn.Module, amp_level: str, dtype: Any) -> None:
    level = module.amp_config.amp_level
    if not isinstance(amp_level, ArgDefault):
        if not isinstance(amp_level, str) or amp_level.upper() != level:
            raise ValueError(
                f"model was compiled at amp_level={level!r} but build_train_step got "
                f"amp_level={amp_level!r}: drop the argument or pass {level!r} (or give "
                f"build_train_step the uncompiled model)"
            )
    if not isinstance(dtype, ArgDefault) and level != "O0":
        asked = dataclasses.replace(module.amp_config, dtype=plain(dtype))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            wanted = asked.resolve(model_device(module)).dtype
        if wanted != module.amp_dtype:
            raise ValueError(
                f"model was compiled with dtype {dtype_name(module.amp_dtype)} but "
                f"build_train_step got dtype={plain(dtype)!r} ({dtype_name(wanted)}): drop the "
                f"argument or pass {dtype_name(module.amp_dtype)!r}"
            )


def train_params(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """Optimizer parameters, then trainable model parameters the optimizer does not hold."""
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    model_ids = {id(p) for p in module.parameters()}
    if not model_ids & seen:
        raise ValueError(
            "the optimizer holds none of the model's parameters: build it on "
            "model.parameters() (the fp32 master weights shared with the compiled module)"
        )
    params += [p for p in module.parameters() if p.requires_grad and id(p) not in seen]
    return params


def distributed_group(network: nn.Module) -> tuple[bool, Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return False, None
    group = network.process_group if isinstance(network, DistributedDataParallel) else None
    return dist.get_world_size(group) > 1, group
