"""AmpConfig: validated compile options, level defaults and dtype resolution."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampgraph.runtime import RUNTIMES
from passes.fx.policy import FX_TABLE, make_policy
from passes.policy import FP32, LEVELS, LOW, LevelPolicy

DTYPE_NAMES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
               "fp16": torch.float16, "float16": torch.float16, "half": torch.float16}
DTYPE_CHOICES = ("auto", "bf16", "fp16", "torch.bfloat16", "torch.float16")
SHORT_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
PRECISIONS = {"fp32": FP32, "float32": FP32, "low": LOW, "bf16": "bf16", "fp16": "fp16"}


def dtype_name(dtype: torch.dtype) -> str:
    """Short name used in reports: bf16, fp16, fp32 (else str(dtype))."""
    return SHORT_NAME.get(dtype, str(dtype).replace("torch.", ""))


def cpu_has_fast_fp16() -> bool:
    """True when this CPU has native fp16 arithmetic (AMX-FP16 or AVX512-FP16)."""
    cpu = getattr(torch, "cpu", None)
    if bool(getattr(cpu, "_is_amx_fp16_supported", lambda: False)()):
        return True
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_fp16" in f.read()
    except OSError:
        return False


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """Turn the user's dtype into a torch dtype for ``device``.

    "auto" is bf16 on CPUs and on CUDA devices that compute bf16 natively (sm_80+), fp16 on
    older CUDA GPUs. fp16 on a CPU without fp16 arithmetic warns.

    Raises:
        ValueError: an unknown dtype string or a non-16-bit dtype.

    Example:
        >>> resolve_dtype("bf16", torch.device("cpu"))
        torch.bfloat16
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"dtype {dtype} is not a 16-bit float: use torch.bfloat16 or torch.float16"
            )
        resolved = dtype
    elif isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key == "auto":
            if device.type == "cuda":
                major, _ = torch.cuda.get_device_capability(device)
                return torch.bfloat16 if major >= 8 else torch.float16
            return torch.bfloat16
        if key not in DTYPE_NAMES:
            raise ValueError(
                f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}"
            )
        resolved = DTYPE_NAMES[key]
    else:
        raise ValueError(
            f"dtype must be a string or torch dtype, got {type(dtype).__name__}: "
            f"choose one of {', '.join(DTYPE_CHOICES)}"
        )
    if resolved == torch.float16 and device.type == "cpu" and not cpu_has_fast_fp16():
        warnings.warn(
            "fp16 on a CPU without fp16 arithmetic: torch falls back to a scalar loop that is "
            "hundreds of times slower than fp32. Use dtype='bf16' (or 'auto') on CPU.",
            RuntimeWarning,
            stacklevel=3,
        )
    return resolved


def _op_key(name: str) -> str | None:
    """'softmax' / 'aten.softmax' / 'aten.softmax.int' -> policy key, or None if not an op."""
    if name in FX_TABLE:
        return name
    parts = name.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    if parts[-1] == "default":  # torch names default overloads without a suffix
        parts = parts[:-1]
    if parts and hasattr(torch.ops.aten, parts[0]):
        return ".".join(["aten", *parts])
    return None


@dataclass(frozen=True)
class AmpConfig:
    """Validated options of one ``ampgraph.compile`` call.

    Attributes:
        amp_level: "O0".."O3".
        dtype: the requested dtype ("auto", "bf16", "fp16" or a torch dtype).
        keep_batchnorm_fp32: None takes the level's default.
        custom_allow / custom_deny: op names, module classes or module-path patterns.
        module_overrides: module-path pattern -> "fp32" | "bf16" | "fp16" | "low".
        keep_io_types: cast outputs back to their original dtype.
        backend: None (the graph runs eagerly) or a ``torch.compile`` backend name.
        runtime: the runtime the graphs call ("cpu", "cuda", "aten"); None: the one of
            the model's device (:func:`runtime_name`).

    Example:
        >>> AmpConfig.create(amp_level="O2").amp_level
        'O2'
    """

    amp_level: str = "O2"
    dtype: Any = "auto"
    keep_batchnorm_fp32: bool | None = None
    custom_allow: tuple = ()
    custom_deny: tuple = ()
    module_overrides: Mapping[str, str] = field(default_factory=dict)
    keep_io_types: bool = True
    backend: str | None = None
    runtime: str | None = None

    @classmethod
    def create(cls, **kwargs: Any) -> AmpConfig:
        """Validate and build; raise ValueError/TypeError with the fix in the message."""
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if not isinstance(self.amp_level, str) or self.amp_level.upper() not in LEVELS:
            raise ValueError(
                f"unknown amp_level {self.amp_level!r}: choose one of O0, O1, O2, O3"
            )
        object.__setattr__(self, "amp_level", self.amp_level.upper())
        if isinstance(self.dtype, str):
            if self.dtype.lower().removeprefix("torch.") not in (*DTYPE_NAMES, "auto"):
                raise ValueError(
                    f"unknown dtype {self.dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}"
                )
        elif self.dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(
                f"unknown dtype {self.dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}"
            )
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError('backend must be None (eager) or a torch.compile backend name '
                            'such as "inductor"')
        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {self.runtime!r}: choose one of "
                             f"{', '.join(sorted(RUNTIMES))}, or None for the model's device's")
        if self.keep_batchnorm_fp32 not in (None, True, False):
            raise TypeError("keep_batchnorm_fp32 must be None, True or False")
        for name in ("custom_allow", "custom_deny"):
            value = getattr(self, name)
            if isinstance(value, (str, type)):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        if self.module_overrides is None:
            object.__setattr__(self, "module_overrides", {})
        if not isinstance(self.module_overrides, Mapping):
            raise TypeError('module_overrides must be a dict like {"classifier": "fp32"}')
        object.__setattr__(self, "module_overrides", dict(self.module_overrides))
        for path, precision in self.module_overrides.items():
            if str(precision).lower() not in PRECISIONS:
                raise ValueError(
                    f"module_overrides[{path!r}] = {precision!r}: choose fp32, bf16, fp16 or low"
                )

    def policy(self, low: torch.dtype) -> LevelPolicy:
        """The painter's policy for this config once the low dtype is known."""
        allow_ops, deny_ops, rules = [], [], []
        for origin, items, ops, precision in (
            ("custom_allow", self.custom_allow, allow_ops, LOW),
            ("custom_deny", self.custom_deny, deny_ops, FP32),
        ):
            for item in items:
                rules_or_ops = _classify_override(item, origin)
                if rules_or_ops[0] == "op":
                    ops.append(rules_or_ops[1])
                else:
                    rules.append((rules_or_ops[1], precision, origin))
        for path, precision in self.module_overrides.items():
            p = PRECISIONS[str(precision).lower()]
            if p in ("bf16", "fp16"):
                if p != dtype_name(low) and low != torch.float32:
                    raise ValueError(
                        f"module_overrides[{path!r}] = {precision!r} but the compile dtype is "
                        f"{dtype_name(low)}: one low dtype per model; use 'low' or 'fp32'"
                    )
                p = LOW
            rules.append((path, p, "module_overrides"))
        return make_policy(
            self.amp_level,
            keep_norm_fp32=self.keep_batchnorm_fp32,
            allow_ops=allow_ops,
            deny_ops=deny_ops,
            module_rules=rules,
        )

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["dtype"] = self.dtype if isinstance(self.dtype, str) else dtype_name(self.dtype)
        d["custom_allow"] = [_item_name(i) for i in self.custom_allow]
        d["custom_deny"] = [_item_name(i) for i in self.custom_deny]
        d["module_overrides"] = dict(self.module_overrides)
        return d


def _item_name(item: Any) -> str:
    return f"class:{item.__module__}.{item.__qualname__}" if isinstance(item, type) else str(item)


def _classify_override(item: Any, origin: str) -> tuple[str, str]:
    if isinstance(item, type):
        if not issubclass(item, nn.Module):
            raise TypeError(f"{origin}: {item!r} is a class but not an nn.Module subclass")
        return "module", f"class:{item.__module__}.{item.__qualname__}"
    if not isinstance(item, str):
        raise TypeError(
            f"{origin} takes op names, nn.Module classes or module-path patterns, got {item!r}"
        )
    key = _op_key(item)
    return ("op", key) if key is not None else ("module", item)


def runtime_name(config: AmpConfig, device: torch.device) -> str:
    """The runtime a compiled module runs on ``device``: the configured one, else the
    device's own (a device without a runtime of its own gets the plain aten one).

    Example:
        >>> runtime_name(AmpConfig(), torch.device("cpu"))
        'cpu'
    """
    if config.runtime is not None:
        return config.runtime
    return device.type if device.type in RUNTIMES else "aten"


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU if it has none)."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")

