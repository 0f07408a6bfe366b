"""FP8Recipe: which matrix products run in FP8 and how they are scaled (the data the
FP8 pass and the runtime's FP8 product read).

The cost rule is shape-based, torchao's auto-filters (``_auto_filter_for_tensorwise`` and
``_auto_filter_for_rowwise`` in ``torchao/float8/float8_linear_utils.py``, torchao 0.18;
measured on H100s): a product pays in FP8 only when its weight is large enough for the FP8
Tensor Cores' speed to outweigh the dynamic scaling's extra passes over the data. torchao
reads ``N, K = weight.shape``, that is ``(out, in)`` as ``nn.Linear`` stores it:

- tensorwise scaling: FP8 unless ``in <= 4096 and out <= 1024``;
- rowwise scaling: FP8 unless ``out <= 2048``, or ``in <= 1024``, or
  ``out <= 4096 and in <= 2048``;
- both: ``out`` and ``in`` multiples of 16 (the FP8 kernels' requirement).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALINGS = ("tensorwise", "rowwise")
WEIGHT_GRADS = ("fp8", "low")
RULES = ("auto", "all")


@dataclass(frozen=True)
class FP8Recipe:
    """FP8 for the matrix products that pay, the rest of the level unchanged.

    Attributes:
        scaling: "tensorwise" (one scale per tensor, torchao's default) or "rowwise" (one
            per row of the activation and of the weight: more accurate, slower kernels).
            Scales are powers of two, computed on the device from each tensor's amax (no
            host synchronisation), so scaling and rounding commute.
        weight_grad: "fp8" (the weight gradient's product in FP8 too, torchao's
            tensorwise recipe) or "low" (in the level's 16-bit dtype, torchao's
            ``rowwise_with_gw_hp``).
        rule: "auto" (torchao's thresholds, above) or "all" (every eligible product whose
            dimensions are multiples of 16: small models in tests).
        keep_first_last: the graph's first and last matrix products stay 16-bit
            (Megatron's ``--first-last-layers-bf16``; the last is the head).
        include: op names (``"aten.linear"``), ``"class:Name"`` or module-path patterns
            whose products run FP8 whatever the rule and position say.
        exclude: the same, kept 16-bit; ``exclude`` wins over ``include``.

    Forward operands are e4m3 (``torch.float8_e4m3fn``); output gradients e5m2
    (``torch.float8_e5m2``). Attention's own products (of two activations), embeddings,
    norms and softmax never run FP8: only products of an activation and a weight do.

    Example:
        >>> ampgraph.compile(model, "O2", "bf16", fp8=FP8Recipe(scaling="rowwise"))
    """

    scaling: str = "tensorwise"
    weight_grad: str = "fp8"
    rule: str = "auto"
    keep_first_last: bool = True
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name, value, allowed in (("scaling", self.scaling, SCALINGS),
                                     ("weight_grad", self.weight_grad, WEIGHT_GRADS),
                                     ("rule", self.rule, RULES)):
            if value not in allowed:
                raise ValueError(f"FP8Recipe: {name} must be one of {allowed}, got {value!r}")
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"FP8Recipe: {name} must be a tuple of strings, got {value!r}")
            object.__setattr__(self, name, tuple(value))

    def shape_verdict(self, out_features: int, in_features: int) -> str | None:
        """None if a weight ``(out, in)`` passes the rule, else why it does not."""
        if out_features % 16 or in_features % 16:
            return (f"weight ({out_features}, {in_features}): dimensions not multiples of 16 "
                    "(FP8 kernels need them)")
        if self.rule == "all":
            return None
        if self.scaling == "tensorwise":
            if in_features <= 4096 and out_features <= 1024:
                return (f"weight ({out_features}, {in_features}) below the tensorwise rule "
                        "(FP8 needs in > 4096 or out > 1024)")
            return None
        if out_features <= 2048 or in_features <= 1024 or (
                out_features <= 4096 and in_features <= 2048):
            return (f"weight ({out_features}, {in_features}) below the rowwise rule (FP8 "
                    "needs out > 2048, in > 1024, and out > 4096 or in > 2048)")
        return None

    def describe(self) -> str:
        """One line for reports: ``"FP8 e4m3/e5m2, tensorwise, weight gradient fp8"``."""
        return f"FP8 e4m3/e5m2, {self.scaling}, weight gradient {self.weight_grad}"


FORWARD_DTYPE = torch.float8_e4m3fn
GRAD_DTYPE = torch.float8_e5m2


def resolve_fp8(value: object) -> FP8Recipe | None:
    """``compile(fp8=...)``: None/False -> None, True -> the default recipe, a recipe as
    it is.

    Raises:
        TypeError: anything else.
    """
    if value is None or value is False:
        return None
    if value is True:
        return FP8Recipe()
    if isinstance(value, FP8Recipe):
        return value
    raise TypeError(f"fp8 must be None, True or an FP8Recipe, got {value!r}")
