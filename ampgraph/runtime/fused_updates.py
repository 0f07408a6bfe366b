"""Fused optimizers' updates made visible: torch's fused kernels write the parameters
without bumping their version counters, so a copy kept per master version (the CUDA
runtime's 16-bit groups, the FP8 weight copies) would go stale. :func:`see_fused_updates`
installs, once per process, an optimizer step hook that bumps them."""

from __future__ import annotations

import itertools
import threading
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

_lock = threading.Lock()
_hook: list = []


def bump_fused_versions(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """After an optimizer's step: bump the version counters of its fused groups'
    parameters (one call)."""
    fused = list(itertools.chain.from_iterable(
        g["params"] for g in optimizer.param_groups if g.get("fused")))
    if fused:
        torch.autograd.graph.increment_version(fused)


def see_fused_updates() -> None:
    """Install :func:`bump_fused_versions` as a global optimizer step hook, once.

    Example:
        >>> see_fused_updates()  # then a fused AdamW step bumps every parameter's version
    """
    with _lock:
        if not _hook:
            _hook.append(register_optimizer_step_post_hook(bump_fused_versions))
