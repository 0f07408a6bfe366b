"""AmpConfig (validated compile options) and its one resolution for a device, ResolvedConfig
(level, dtype, runtime), which everything that compiles or converts reads."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampgraph.runtime import RUNTIMES
from ampgraph.runtime.compiled import parse_compile_options
from passes.fx.fp8_recipe import FP8Recipe, resolve_fp8
from passes.fx.policy import FX_TABLE, make_policy
from passes.fx.routing.head_loss import HEAD_LOSS_MODES
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


def parse_level(level: Any) -> str:
    """The user's amp_level, upper-cased: ``"o2"`` -> ``"O2"``.

    Raises:
        ValueError: anything but O0-O3.

    Example:
        >>> parse_level("o2")
        'O2'
    """
    if not isinstance(level, str) or level.upper() not in LEVELS:
        raise ValueError(f"unknown amp_level {level!r}: choose one of {', '.join(LEVELS)}")
    return level.upper()


def parse_dtype(dtype: Any) -> torch.dtype | str:
    """The user's dtype as a 16-bit torch dtype, or ``"auto"`` (which a device resolves).

    Raises:
        ValueError: an unknown name, a dtype that is not a 16-bit float, or another type.

    Example:
        >>> parse_dtype("bfloat16"), parse_dtype("AUTO")
        (torch.bfloat16, 'auto')
    """
    why = ""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.bfloat16, torch.float16):
            return dtype
        why = " (not a 16-bit float)"
    elif isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key == "auto":
            return "auto"
        if key in DTYPE_NAMES:
            return DTYPE_NAMES[key]
        if isinstance(getattr(torch, key, None), torch.dtype):
            why = " (not a 16-bit float)"
    else:
        why = f" (of type {type(dtype).__name__})"
    raise ValueError(f"unknown dtype {dtype!r}{why}: choose one of {', '.join(DTYPE_CHOICES)}")


def _onnx_dtype(dtype: Any) -> torch.dtype:
    """The low dtype of an ONNX graph: named, since a graph has no device to pick one for."""
    try:
        parsed = parse_dtype(dtype)
    except ValueError:
        parsed = None
    if not isinstance(parsed, torch.dtype):
        raise ValueError(f"unknown dtype {dtype!r} for ONNX: choose 'fp16' or 'bf16'")
    return parsed


def _device_dtype(dtype: torch.dtype | str, device: torch.device) -> torch.dtype:
    """A parsed dtype on ``device``: "auto" is bf16 on CPUs and on CUDA devices that compute
    bf16 natively (sm_80+), fp16 on older CUDA GPUs; fp16 on a CPU without fp16 arithmetic
    warns."""
    if dtype == "auto":
        if device.type == "cuda":
            major, _ = torch.cuda.get_device_capability(device)
            return torch.bfloat16 if major >= 8 else torch.float16
        return torch.bfloat16
    if dtype == torch.float16 and device.type == "cpu" and not cpu_has_fast_fp16():
        warnings.warn(
            "fp16 on a CPU without fp16 arithmetic: torch falls back to a scalar loop that is "
            "hundreds of times slower than fp32. Use dtype='bf16' (or 'auto') on CPU.",
            RuntimeWarning,
            stacklevel=4,
        )
    return dtype


def _runtime_on(runtime: str | None, device: torch.device | None) -> str | None:
    """The configured runtime, else the device's own (the plain aten one for a device
    without a runtime of its own); None for an ONNX graph."""
    if runtime is not None or device is None:
        return runtime
    return device.type if device.type in RUNTIMES else "aten"


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
        compile_options: with a backend, ``torch.compile``'s keyword arguments
            (``runtime/compiled.py``'s ``COMPILE_OPTIONS``: ``mode``, ``options``,
            ``dynamic``, ``fullgraph``); ``dynamic`` is True unless given.
        runtime: the runtime the graphs call ("cpu", "cuda", "aten"); None: the one of
            the model's device (:meth:`resolve`).
        head_loss: "auto", "drop_logits" or "off" (``passes.fx.routing.head_loss``).
        fp8: None, or the :class:`~passes.fx.fp8_recipe.FP8Recipe` of the products that
            run in FP8 (``True`` at :meth:`create`: the default recipe).

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
    compile_options: Mapping[str, Any] = field(default_factory=dict)
    runtime: str | None = None
    fp8: FP8Recipe | None = None
    head_loss: str = "auto"

    @classmethod
    def create(cls, **kwargs: Any) -> AmpConfig:
        """Validate and build; raise ValueError/TypeError with the fix in the message."""
        cfg = cls(**kwargs)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        object.__setattr__(self, "amp_level", parse_level(self.amp_level))
        parse_dtype(self.dtype)
        if self.backend is not None and not isinstance(self.backend, str):
            raise TypeError('backend must be None (eager) or a torch.compile backend name '
                            'such as "inductor"')
        object.__setattr__(self, "compile_options",
                           parse_compile_options(self.compile_options, self.backend))
        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise ValueError(f"unknown runtime {self.runtime!r}: choose one of "
                             f"{', '.join(sorted(RUNTIMES))}, or None for the model's device's")
        object.__setattr__(self, "fp8", resolve_fp8(self.fp8))
        if self.fp8 is not None and parse_level(self.amp_level) == "O0":
            raise ValueError("fp8 runs products below the level's 16-bit dtype: use it at "
                             "O1-O3, not O0")
        if self.head_loss not in HEAD_LOSS_MODES:
            raise ValueError(f"head_loss must be one of {', '.join(HEAD_LOSS_MODES)}, got "
                             f"{self.head_loss!r}")
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

    def resolve(self, device: torch.device | None) -> ResolvedConfig:
        """This configuration for where the model runs: the one resolution of the level,
        the dtype and the runtime, made once and handed to everything that compiles
        (``compile``, ``build_train_step``, the trainer integrations, the CLI) or converts
        (``convert_onnx``, ``export_onnx``).

        Args:
            device: the model's device; None for an ONNX graph, which has no device: its
                dtype must be named ("fp16" or "bf16", not "auto") and it has no runtime.

        Raises:
            ValueError: an unknown level or dtype (for ONNX: not fp16 or bf16).

        Example:
            >>> AmpConfig.create(dtype="auto").resolve(torch.device("cpu")).dtype
            torch.bfloat16
        """
        level = parse_level(self.amp_level)
        dtype = parse_dtype(self.dtype) if device is not None else _onnx_dtype(self.dtype)
        if level == "O0":  # nothing runs low: no device choice, no warning
            low = torch.float32
        elif device is None:
            low = dtype
        else:
            low = _device_dtype(dtype, device)
        config = self if level == self.amp_level else dataclasses.replace(self, amp_level=level)
        return ResolvedConfig(config, low, device, _runtime_on(self.runtime, device))

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
        d["compile_options"] = dict(self.compile_options)
        return d


@dataclass(frozen=True)
class ResolvedConfig:
    """An :class:`AmpConfig` resolved for where the model runs (:meth:`AmpConfig.resolve`):
    what every compile and conversion reads, so the dtype, the level and the runtime are
    decided in one place.

    Attributes:
        config: the validated options as given (its dtype may still read "auto").
        dtype: the dtype low-precision ops compute in: bf16 or fp16; fp32 at O0.
        device: the device it was resolved for; None for an ONNX graph.
        runtime: the runtime the graphs call there ("cpu", "cuda", "aten"); None for ONNX.

    Example:
        >>> resolved = AmpConfig.create(amp_level="o1").resolve(torch.device("cpu"))
        >>> resolved.level, resolved.dtype, resolved.runtime
        ('O1', torch.bfloat16, 'cpu')
    """

    config: AmpConfig
    dtype: torch.dtype
    device: torch.device | None
    runtime: str | None

    @property
    def level(self) -> str:
        """"O0".."O3"."""
        return self.config.amp_level

    @property
    def backend(self) -> str | None:
        """None (the graph runs eagerly) or the ``torch.compile`` backend name."""
        return self.config.backend

    @property
    def compile_options(self) -> dict[str, Any]:
        """``torch.compile``'s keyword arguments with the backend (validated)."""
        return self.config.compile_options

    def policy(self) -> LevelPolicy:
        """The painter's policy at this level, dtype and overrides."""
        return self.config.policy(self.dtype)

    def runtime_on(self, device: torch.device) -> str:
        """The runtime for ``device`` (the model moved after it was compiled): the configured
        one, else the device's own; the dtype stays the resolved one.

        Example:
            >>> AmpConfig.create().resolve(torch.device("cpu")).runtime_on(torch.device("meta"))
            'aten'
        """
        return _runtime_on(self.config.runtime, device)


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


def model_device(model: nn.Module) -> torch.device:
    """The device of the model's first parameter or buffer (CPU if it has none)."""
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")

