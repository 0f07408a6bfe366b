"""Capture leaves the process as it found it: grad and inference mode, autocast, the default
dtype, torch function/dispatch mode stacks and RNG are restored whether export succeeds or
fails (``preserved_global_state``)."""


from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator

import torch

AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def preserved_global_state(rng: bool = True) -> Iterator[None]:
    """Leave the process as the body found it, whether the body returns or raises.

    A capture attempt runs the user's forward under torch.export's tracer and re-runs ops
    in the AMP passes; either can leave thread-local state behind (torch 2.13's
    ``wrap_with_set_grad_enabled`` higher-order op, re-run on a submodule that cannot be
    called, raises with grad mode still off). Restored here: grad mode, forward-mode AD,
    inference mode (the autograd and dispatch-key thread-local state, through an
    ``InferenceMode`` guard entered in the state it found), autocast for CPU and CUDA
    (enabled, dtype, weight cache, nesting), the default dtype, torch function and
    dispatch mode stacks, and with ``rng`` the CPU, initialised CUDA and Python RNG states
    (tracing must not consume the numbers the real forward draws).
    """
    grad = torch.is_grad_enabled()
    fwd_grad = torch._C._is_fwd_grad_enabled()
    inference = torch.is_inference_mode_enabled()
    default_dtype = torch.get_default_dtype()
    autocast = {d: (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                for d in AUTOCAST_DEVICES}
    autocast_cache = torch.is_autocast_cache_enabled()
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    function_modes = torch._C._len_torch_function_stack()
    dispatch_modes = torch._C._len_torch_dispatch_stack()
    if rng:
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        py_rng = random.getstate()
    # Its destructor puts back the autograd state and dispatch keys it found; entering it
    # in the current inference mode changes grad modes only, and those are set back now.
    guard = torch._C._InferenceMode(inference)
    torch._C._set_grad_enabled(grad)
    torch._C._set_fwd_grad_enabled(fwd_grad)
    try:
        yield
    finally:
        while torch._C._len_torch_function_stack() > function_modes:
            torch._C._pop_torch_function_stack()
        while torch._C._len_torch_dispatch_stack() > dispatch_modes:
            torch._C._pop_torch_dispatch_stack()
        del guard
        torch._C._set_grad_enabled(grad)
        torch._C._set_fwd_grad_enabled(fwd_grad)
        torch.set_default_dtype(default_dtype)
        for device, (enabled, dtype) in autocast.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(autocast_cache)
        now = torch.autocast_increment_nesting() - 1
        torch.autocast_decrement_nesting()
        while now > nesting:
            now = torch.autocast_decrement_nesting()
        while now < nesting:
            now = torch.autocast_increment_nesting()
        if rng:
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            random.setstate(py_rng)
