"""``build_train_step(..., memory=...)``: one knob for the step's memory tiers.

- ``"default"``: fp32 master weights, AdamW's state in fp32, the head and its loss fused;
  the gradients stay in ``p.grad`` until the next step.
- ``"lean"``: the same with ``release_grads=True`` (``release_grads.py``): each parameter
  stepped in backward and its gradient freed there.
- ``"leanest"``: ``"lean"`` with ``master_weights="stochastic"``: weights and optimizer
  state in bf16, stochastic-rounding updates (``low_precision_weights.py``).

docs/training.md#memory gives each tier's bytes per parameter, what it gives up, and the
totals measured by ``benchmarks/memory.py``.
"""

from __future__ import annotations

__all__ = ["MEMORY_TIERS", "resolve_memory"]

MEMORY_TIERS: dict[str, dict] = {
    "default": {"master_weights": "fp32", "release_grads": False},
    "lean": {"master_weights": "fp32", "release_grads": True},
    "leanest": {"master_weights": "stochastic", "release_grads": True},
}


def resolve_memory(memory: str | None, master_weights: str, release_grads: bool
                   ) -> tuple[str, bool]:
    """``(master_weights, release_grads)`` for the tier ``memory`` (None: the two as given).
    A tier and an explicit value of either that contradicts it are refused.

    Example:
        >>> resolve_memory("leanest", "fp32", False)
        ('stochastic', True)
    """
    if memory is None:
        return master_weights, release_grads
    if memory not in MEMORY_TIERS:
        raise ValueError(f"memory must be one of {', '.join(MEMORY_TIERS)} or None, got "
                         f"{memory!r}")
    tier = MEMORY_TIERS[memory]
    given = {"master_weights": master_weights, "release_grads": release_grads}
    default = {"master_weights": "fp32", "release_grads": False}
    for name, value in given.items():
        if value != default[name] and value != tier[name]:
            raise ValueError(f"memory={memory!r} means {name}={tier[name]!r}, but "
                             f"{name}={value!r} was given: pass one or the other")
    return tier["master_weights"], tier["release_grads"]
