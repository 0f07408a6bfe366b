"""``ampgraph.compile``: the one call that turns a model into a mixed-precision one."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ampgraph.config import AmpConfig, ResolvedConfig, model_device
from ampgraph.module import AmpModule
from passes.fx.fp8_recipe import FP8Recipe


def compile(  # noqa: A001 - the public name mirrors torch.compile
    model: nn.Module,
    amp_level: str = "O2",
    dtype: str | torch.dtype = "auto",
    *,
    keep_batchnorm_fp32: bool | None = None,
    custom_allow: Iterable[Any] = (),
    custom_deny: Iterable[Any] = (),
    module_overrides: Mapping[str, str] | None = None,
    keep_io_types: bool = True,
    backend: str | None = None,
    compile_options: Mapping[str, Any] | None = None,
    runtime: str | None = None,
    fp8: bool | FP8Recipe | None = None,
    head_loss: str = "auto",
) -> nn.Module:
    """Rewrite ``model``'s graph for mixed precision at ``amp_level``.

    The model is captured with ``torch.export`` on its first call (again when the mode or
    the input structure changes, or when an input falls outside what the graph was
    specialised on: batch and sequence sizes stay dynamic, an image batch a convolution of
    the model takes keeps its channels, height and width); each node gets a precision by the
    level's rules and casts are inserted where precision changes. Parameters stay fp32 and
    are shared with ``model``; outputs come back in their original dtype.

    Args:
        model: the fp32 module.
        amp_level: "O0" (nothing), "O1" (allow-list ops low), "O2" (all low but the deny
            list), "O3" (all low).
        dtype: "auto" | "bf16" | "fp16" | torch.bfloat16 | torch.float16.
        keep_batchnorm_fp32: keep norm layers fp32 (default: True for O1/O2, False for O3).
        custom_allow: op names, module classes or module-path patterns forced to low.
        custom_deny: op names, module classes or module-path patterns forced to fp32.
        module_overrides: module-path pattern -> "fp32" | "bf16" | "fp16" | "low".
        keep_io_types: cast float outputs back to their original dtype (eagerly on the CPU,
            an output of 32 MiB or more, such as a language model's logits, goes into one
            of two buffers the module keeps for it, once the caller and any graph have let
            go of the last one there; ``clear_weight_cache()`` drops them).
        backend: None runs the rewritten graph eagerly (parameters cast once per forward,
            inference reuses low-precision working copies); "inductor" hands the rewritten
            graph to ``torch.compile`` so casts fuse with their neighbours. Calls without
            gradients then run a second compiled graph that takes the weights' kept
            low-precision copies as inputs (made again only when a master changes) and
            leaves casting the outputs back to the runtime (kept buffers for large ones).
        compile_options: with a ``backend``, ``torch.compile``'s keyword arguments:
            ``mode`` ("default", "reduce-overhead", "max-autotune",
            "max-autotune-no-cudagraphs"; inductor only), ``options`` (inductor config,
            instead of a mode), ``dynamic`` (True unless given: batch and sequence sizes
            stay dynamic, as in the captured graph), ``fullgraph``.
        runtime: what the graphs call at run time: None picks the model's device's at its
            first call ("cpu": kept buffers, packed inference weights; "cuda": low-precision
            weights refreshed once per step by multi-tensor ops); naming one selects it on
            any device ("aten": every op aten's own).
        fp8: the matrix products that pay run in FP8 (e4m3 forward, e5m2 gradients,
            dynamic power-of-two scales; the rest of the level as it is): True for the
            default :class:`~ampgraph.FP8Recipe` (torchao's shape rule, the first and last
            products 16-bit), or a recipe. ``explain`` says for each product why it does or
            does not run FP8. On the CPU the FP8 products are emulated exactly (the
            operands rounded to FP8, the product in bf16): for numerics, not speed.
        head_loss: where the graph computes a cross-entropy on the logits of its last
            product (an HF language model given ``labels``), run both as one op in
            chunks of tokens, so the logits never exist whole (docs/training.md#memory):
            "auto" (default) where nothing else reads the logits; "drop_logits" also
            where the model returns them, as HF's models do: the output's logits are then
            None in training mode (evaluation keeps them; Liger-Kernel's patched forwards
            do the same); "off". ``build_train_step`` drops them for its own calls, which
            read only the loss. Not with a ``backend``.

    Returns:
        An :class:`~ampgraph.AmpModule` sharing ``model``'s parameters.

    Raises:
        TypeError: ``model`` is not an nn.Module.
        ValueError: an unknown level or dtype, contradictory overrides, a model on the meta
            device or with fp16/bf16 parameters, ``compile_options`` without a backend, with
            an unknown key or mode, or with inductor's ``mode``/``options`` for another
            backend.

    Example:
        >>> net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
        >>> logits = net(x)
        >>> fast = ampgraph.compile(model, "O2", "bf16", backend="inductor",
        ...                         compile_options={"mode": "max-autotune"})
    """
    _check_module(model)
    config = AmpConfig.create(
        amp_level=amp_level,
        dtype=dtype,
        keep_batchnorm_fp32=keep_batchnorm_fp32,
        custom_allow=custom_allow,
        custom_deny=custom_deny,
        module_overrides={} if module_overrides is None else module_overrides,
        keep_io_types=keep_io_types,
        backend=backend,
        compile_options=compile_options,
        runtime=runtime,
        fp8=fp8,
        head_loss=head_loss,
    )
    return compile_resolved(model, config.resolve(model_device(model)))


def compile_resolved(model: nn.Module, config: ResolvedConfig, path: str = "") -> nn.Module:
    """:func:`compile` with a configuration already resolved, for callers that resolve once
    for several modules or for another device than the model's (the Lightning plugin
    resolves on the Trainer's device and compiles each child with the result). ``path``:
    where ``model`` sits in the model being compiled region by region, for
    ``module_overrides``' patterns.

    Raises:
        TypeError, ValueError: as :func:`compile`.

    Example:
        >>> resolved = AmpConfig.create(dtype="bf16").resolve(torch.device("cpu"))
        >>> net = compile_resolved(model, resolved)
    """
    _check_module(model)
    if isinstance(model, AmpModule):
        done = model.amp_resolved
        same = dataclasses.replace(config.config, dtype=done.config.dtype) == done.config
        if same and done.dtype == config.dtype:  # "bf16", torch.bfloat16, "auto" alike
            return model
        raise ValueError(
            f"this module was already compiled at {done.level} "
            f"({done.dtype}); compile the original module "
            "(net.original_module) instead of compiling twice"
        )
    config.policy()  # raise on contradictory overrides now, not at the first call
    _check_parameters(model)
    return AmpModule(model, config, path)


def _check_module(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"ampgraph.compile expects a torch.nn.Module, got {type(model).__name__}; "
            "wrap a function in an nn.Module first"
        )


def _check_parameters(model: nn.Module) -> None:
    tensors = [*model.named_parameters(), *model.named_buffers()]
    meta = [name for name, t in tensors if t.is_meta]
    if meta:
        raise ValueError(
            f"the model is on the meta device ({meta[0]} has no data): materialise it first, "
            "e.g. model.to_empty(device='cpu') and load its weights, then compile"
        )
    low = [(name, p.dtype) for name, p in model.named_parameters()
           if p.dtype in (torch.float16, torch.bfloat16)]
    if low:
        raise ValueError(
            f"parameter {low[0][0]} is already {low[0][1]}: ampgraph keeps fp32 master weights "
            "and casts on use, so compile the fp32 model (call model.float() first)"
        )
