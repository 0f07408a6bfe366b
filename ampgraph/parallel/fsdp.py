"""One call to shard a model for mixed precision with FSDP2: :func:`shard`.

Each block is compiled and sharded (``fully_shard``) on its own, the modules around the
blocks (embeddings, the final norm, the head) are compiled and sharded with the root, and
every group gathers its parameters in the level's 16-bit dtype (FSDP2's
``MixedPrecisionPolicy``, as torchtitan trains Llama 3): half the all-gather bytes of fp32.
The graphs then take the gathered 16-bit weights as they are, with no second copy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampgraph.config import AmpConfig, ResolvedConfig, model_device
from ampgraph.parallel.regions import compile_regions, find_blocks

PARAM_GATHER = ("low", "fp32")


def shard(
    model: nn.Module,
    mesh: Any = None,
    amp_level: str = "O2",
    dtype: str | torch.dtype = "auto",
    *,
    blocks: Iterable[Any] | None = None,
    reduce_dtype: torch.dtype = torch.float32,
    gather: str = "low",
    reshard_after_forward: bool = True,
    **compile_kwargs: Any,
) -> nn.Module:
    """Compile ``model`` region by region and shard it with FSDP2, in place.

    Each block is compiled (:func:`ampgraph.compile` with these arguments) and
    ``fully_shard``-ed; then each module around the blocks that holds parameters or buffers
    is compiled, and the root is sharded, holding those. The code between the compiled
    modules (the root's own forward: masks, the loop over blocks) runs as written;
    ``ampgraph.explain(model)`` lists it.

    Args:
        model: the fp32 model (on its device: "cuda" with NCCL, "cpu" with gloo).
        mesh: FSDP2's ``DeviceMesh``; None: a 1-D mesh over the default process group, or,
            with no process group, no sharding (only the regional compilation).
        amp_level, dtype: as :func:`ampgraph.compile`.
        blocks: what to compile and shard as a block: module classes, class names or
            module-path patterns (``"model.layers.*"``); None: the classes an HF model
            lists in ``_no_split_modules``, else a ``ModuleList``'s items.
        reduce_dtype: the dtype gradients are reduce-scattered in: fp32 (default, as
            torchtitan), or the low dtype to halve those bytes too.
        gather: "low" (default): every parameter is all-gathered in the low dtype, norms'
            weights included (rounded to it, then computed in fp32 where the level keeps
            the norm fp32; the fp32 masters are updated in fp32). "fp32": parameters are
            gathered in fp32 and the graphs cast them (twice the all-gather bytes; the
            weights of fp32 ops are exact). A compiled block calls no submodule's own
            forward, so FSDP2 cannot gather a block's norms apart from the block.
        reshard_after_forward: FSDP2's, for the blocks (the root keeps its parameters
            gathered until backward, as FSDP2 does).
        **compile_kwargs: the rest of :func:`ampgraph.compile`'s keyword arguments.

    Returns:
        ``model`` itself, compiled and sharded (its parameters are DTensors).

    Raises:
        ValueError: no block found, an unknown ``gather``, a model already sharded.

    Example:
        >>> mesh = init_device_mesh("cuda", (world_size,))
        >>> model = ampgraph.shard(model, mesh, amp_level="O2", dtype="bf16")
        >>> opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
        >>> step = ampgraph.build_train_step(model, loss_fn, opt)
    """
    if gather not in PARAM_GATHER:
        raise ValueError(f"gather must be one of {PARAM_GATHER}, got {gather!r}")
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("the model is already sharded: give ampgraph.shard the unsharded "
                         "model; it compiles, then shards")
    config = AmpConfig.create(amp_level=amp_level, dtype=dtype,
                              **_compile_config(compile_kwargs)).resolve(model_device(model))
    compiled = compile_regions(model, config, find_blocks(model, blocks))
    mesh = _default_mesh(model) if mesh is None else mesh
    if mesh is None:
        return model
    policy = mixed_precision_policy(config, reduce_dtype, gather)
    for block in compiled:
        fully_shard(block, mesh=mesh, mp_policy=policy,
                    reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def mixed_precision_policy(config: ResolvedConfig, reduce_dtype: torch.dtype = torch.float32,
                           gather: str = "low") -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for a compiled level: parameters gathered in the low
    dtype (fp32 at O0 or with ``gather="fp32"``), gradients reduced in ``reduce_dtype``.
    Inputs are not cast: the graphs cast what their level runs low.

    Example:
        >>> mixed_precision_policy(AmpConfig.create(dtype="bf16").resolve(None))
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, ...)
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if reduce_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"reduce_dtype must be torch.float32, bfloat16 or float16, got "
                         f"{reduce_dtype!r}")
    low = gather == "low" and config.level != "O0"
    return MixedPrecisionPolicy(param_dtype=config.dtype if low else None,
                                reduce_dtype=reduce_dtype, cast_forward_inputs=False)


def _compile_config(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    if out.get("module_overrides") is None:
        out.pop("module_overrides", None)
    return out


def _default_mesh(model: nn.Module) -> Any:
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(model_device(model).type, (dist.get_world_size(),))

