"""Device-capability probes: what the kernels on a device accept, learnt by running them.

Kernels differ by device and torch version, so the passes ask the device rather than a
table: a probe runs the op forward and backward on tiny tensors, once per (op, device,
dtype) in a process (``functools.cache``).
"""

from __future__ import annotations

import functools

import torch

aten = torch.ops.aten


@functools.cache
def mixed_io_supported(target, device: torch.device | None, low: torch.dtype) -> bool:
    """Whether ``target`` runs forward and backward with a ``low`` input and fp32 weights on
    ``device`` (a real run on tiny tensors: kernels differ by device and version).

    Used by ``passes.fx.fusions.fuse_norm_casts``: a norm (layer, group or batch norm) is
    fed its low-precision input directly only where this holds.

    Example:
        >>> mixed_io_supported(aten.layer_norm.default, torch.device("cpu"), torch.bfloat16)
        True
    """
    if device is None:
        return False
    try:
        with torch.inference_mode(False), torch.enable_grad():
            x = torch.randn(4, 4, 3, device=device, dtype=low, requires_grad=True)
            w = torch.ones(4, device=device, requires_grad=True)
            b = torch.zeros(4, device=device, requires_grad=True)
            stats = (torch.zeros(4, device=device), torch.ones(4, device=device))
            if target in (aten.layer_norm.default, aten.native_layer_norm.default):
                y = aten.native_layer_norm(x.transpose(1, 2), [4], w, b, 1e-5)[0]
            elif target in (aten.group_norm.default, aten.native_group_norm.default):
                y = aten.group_norm(x, 2, w, b, 1e-5)
            else:
                y = aten.batch_norm(x, w, b, *stats, True, 0.1, 1e-5, False)
                aten.batch_norm(x.detach(), w, b, *stats, False, 0.1, 1e-5, False)
            y.float().sum().backward()
        real = not y.is_meta  # a tensor without data proves nothing
        return real and y.dtype == low and x.grad.dtype == low and w.grad.dtype == torch.float32
    except Exception:  # no such device here, or a kernel that refuses: no fusion
        return False
