"""Capture leaves the process as it found it: grad and inference mode, autocast, the default
dtype, torch function/dispatch mode stacks and RNG are restored whether export succeeds or
fails (``preserved_global_state``), and the input tensors lose the dimension marks export
leaves on them (``unmarked_dims``)."""


from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator

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
    (tracing must not consume the numbers the real forward draws). Each piece is put back
    even when putting back another fails; the first such failure is raised afterwards.
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
    guard = [torch._C._InferenceMode(inference)]
    torch._C._set_grad_enabled(grad)
    torch._C._set_fwd_grad_enabled(fwd_grad)

    def pop_modes() -> None:
        while torch._C._len_torch_function_stack() > function_modes:
            torch._C._pop_torch_function_stack()
        while torch._C._len_torch_dispatch_stack() > dispatch_modes:
            _pop_dispatch_mode()

    def grad_modes() -> None:
        guard.clear()  # its destructor runs now, before grad modes are set
        torch._C._set_grad_enabled(grad)
        torch._C._set_fwd_grad_enabled(fwd_grad)

    def autocast_state() -> None:
        for device, (enabled, dtype) in autocast.items():
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(autocast_cache)

    def autocast_nesting() -> None:
        now = torch.autocast_increment_nesting() - 1
        torch.autocast_decrement_nesting()
        while now > nesting:
            now = torch.autocast_decrement_nesting()
        while now < nesting:
            now = torch.autocast_increment_nesting()

    steps = [pop_modes, grad_modes, lambda: torch.set_default_dtype(default_dtype),
             autocast_state, autocast_nesting]
    if rng:
        steps.append(lambda: torch.set_rng_state(cpu_rng))
        if cuda_rng is not None:
            steps.append(lambda: torch.cuda.set_rng_state_all(cuda_rng))
        steps.append(lambda: random.setstate(py_rng))
    try:
        yield
    finally:
        _run_all(steps)


def _pop_dispatch_mode() -> None:
    """Pop the innermost torch dispatch mode (a Python mode, or else the infra mode of
    highest priority), whichever signature this torch's binding has: torch 2.13's takes
    the mode key as a required argument (None: the innermost mode), older ones make it
    optional or take none."""
    try:
        torch._C._pop_torch_dispatch_stack(None)
    except TypeError:  # a binding without the mode key argument
        torch._C._pop_torch_dispatch_stack()


def _run_all(steps: Iterable[Callable[[], object]]) -> None:
    """Run every step even when one fails; then raise the first failure, the others as
    notes on it (a state that cannot be put back is a bug, not to be hidden, but the rest
    of the state is put back first)."""
    errors: list[Exception] = []
    for step in steps:
        try:
            step()
        except Exception as exc:  # noqa: BLE001 - raised below, after the other steps
            errors.append(exc)
    if errors:
        first = errors[0]
        for other in errors[1:]:
            first.add_note(f"restoring the global state also failed: "
                           f"{type(other).__name__}: {other}")
        raise first


# what torch.export writes on the input tensors it makes dynamic (torch._export's
# _clean_dynamic_markers deletes them only after a successful non-strict export)
DIM_MARKS = ("_dynamo_weak_dynamic_indices", "_dynamo_dynamic_indices", "_dynamo_dynamic_range",
             "_dynamo_static_indices", "_dynamo_unbacked_indices",
             "_dynamo_propagated_dynamic_indices", "_has_dynamo_dim_marking")


def clear_dim_marks(tensors: Iterable[torch.Tensor]) -> None:
    """Delete the dimension marks torch.export put on ``tensors``: after a failed export
    they stay, and the next export of the same tensors (static sizes, or an eager
    fallback's child given an input passed down) makes those dimensions dynamic again.

    Example:
        >>> clear_dim_marks([x])
    """
    for t in tensors:
        for attr in DIM_MARKS:
            if attr in t.__dict__:
                delattr(t, attr)


@contextlib.contextmanager
def unmarked_dims(tensors: Iterable[torch.Tensor]) -> Iterator[None]:
    """:func:`clear_dim_marks` on ``tensors`` when the body returns or raises.

    Example:
        >>> with unmarked_dims(leaves):
        ...     torch.export.export(model, args, dynamic_shapes=spec, strict=False)
    """
    tensors = list(tensors)
    try:
        yield
    finally:
        clear_dim_marks(tensors)
