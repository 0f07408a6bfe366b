"""What rewritten graphs call at run time: one runtime per kind of device.

- ``base.py``: :class:`Runtime`, what every runtime provides (every op aten's own: the
  runtime of devices without a folder here);
- ``cpu/``: the CPU's (kept buffers, blocked products, packed inference weights,
  unfused attention, the faster dropout draw);
- ``cuda/``: the GPU's (weights refreshed once per step by multi-tensor ops);
- ``grad_scale.py``: per-layer loss scaling's gradient-scale op, on every device;
- ``compiled.py``: a graph handed to ``torch.compile`` (``compile(..., backend=...)``), the
  runtime doing its edges around the compiled code.

``AmpModule`` asks :func:`make_runtime` for the runtime its resolved configuration names.
Adding a device is adding a folder and a line in :data:`RUNTIMES`. Imports nothing from
``ampgraph`` outside ``runtime/`` (``tests/test_layering.py``).
"""

from __future__ import annotations

from ampgraph.runtime.base import CompiledEdges, Runtime
from ampgraph.runtime.compiled import compiled_runner
from ampgraph.runtime.cpu.runtime import CpuRuntime
from ampgraph.runtime.cuda.runtime import CudaRuntime

RUNTIMES: dict[str, type[Runtime]] = {"cpu": CpuRuntime, "cuda": CudaRuntime, "aten": Runtime}


def make_runtime(name: str) -> Runtime:
    """A new runtime of the kind ``name`` (a key of :data:`RUNTIMES`).

    Example:
        >>> make_runtime("cuda").name
        'cuda'
    """
    try:
        return RUNTIMES[name]()
    except KeyError:
        raise ValueError(f"unknown runtime {name!r}: choose one of "
                         f"{', '.join(sorted(RUNTIMES))} (or None: the model's device's)"
                         ) from None


__all__ = ["RUNTIMES", "CompiledEdges", "Runtime", "compiled_runner", "make_runtime"]
