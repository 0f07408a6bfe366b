"""DDP's gradient all-reduce in 16 bits, opt-in: :func:`compress_ddp_gradients`."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ampgraph.config import parse_dtype

HOOKS = {torch.bfloat16: "bf16_compress_hook", torch.float16: "fp16_compress_hook"}


def compress_ddp_gradients(ddp_model: nn.Module, dtype: str | torch.dtype = "bf16",
                           process_group: Any = None) -> None:
    """All-reduce ``ddp_model``'s gradient buckets in ``dtype`` (half the bytes of fp32)
    with torch's own comm hook (``bf16_compress_hook`` / ``fp16_compress_hook``).

    The trade-off: each rank's fp32 gradient is rounded to 16 bits before the sum, and the
    sum is taken in 16 bits, then written back into the fp32 gradient. bf16 keeps fp32's
    range but about 3 significant digits (relative error up to 2**-8 per element, and the
    sum of N ranks rounds again); fp16 keeps 3-4 digits but overflows above 65504 and
    flushes below 6e-8 after the division by the world size, so with fp16 loss scaling
    an overflowing bucket comes back inf and the step's overflow check skips that step on
    every rank. Gradient clipping and the optimizer still run in fp32. Leave it off where
    the update is sensitive to small gradient components (late fine-tuning at tiny
    learning rates); DDP's default all-reduce is fp32.

    Args:
        ddp_model: a ``DistributedDataParallel`` (around an ``ampgraph.compile``d module or
            any other), before its first backward.
        dtype: "bf16" | "fp16" | torch.bfloat16 | torch.float16.
        process_group: the hook's group; None: DDP's.

    Raises:
        TypeError: not a DistributedDataParallel.
        ValueError: another dtype.

    Example:
        >>> ddp = DistributedDataParallel(ampgraph.compile(model, "O2", "bf16"))
        >>> compress_ddp_gradients(ddp, "bf16")
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"compress_ddp_gradients expects a DistributedDataParallel, got "
                        f"{type(ddp_model).__name__}")
    low = parse_dtype(dtype)
    if low not in HOOKS:
        raise ValueError(f"dtype must be bf16 or fp16, got {dtype!r}")
    hook = getattr(default_hooks, HOOKS[low])
    group = ddp_model.process_group if process_group is None else process_group
    if low == torch.bfloat16 and dist.get_backend(group) == "gloo":
        hook = gloo_bf16_compress_hook
    ddp_model.register_comm_hook(process_group, hook)


def gloo_bf16_compress_hook(process_group, bucket):  # no annotations: DDP checks them
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name unless CUDA
    and NCCL 2.10+ are present (NCCL's bf16 support), while gloo sums bf16 on the CPU."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(process_group, bucket)
