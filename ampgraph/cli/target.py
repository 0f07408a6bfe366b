"""CLI targets: ``.onnx`` files and ``file.py:function`` / ``package.module:function`` factories.

Everything here raises :class:`CliError` with a message that says what was wrong and how to
fix it; ``ampgraph.cli`` prints it on one line and exits with code 2. Parsing (shapes,
dtypes, target specs) does not import torch, so argument errors are reported fast.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

INPUT_DTYPES = {
    "float32": "float32", "fp32": "float32", "float": "float32",
    "float16": "float16", "fp16": "float16", "half": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16",
    "float64": "float64", "fp64": "float64", "double": "float64",
    "int64": "int64", "long": "int64", "int32": "int32", "int": "int32",
    "bool": "bool",
}
LEVEL_NAMES = ("O0", "O1", "O2", "O3")


class CliError(Exception):
    """A user error: printed as one line on stderr, exit code 2."""


@dataclass
class Target:
    """A parsed TARGET argument.

    Attributes:
        spec: the string as given.
        kind: "onnx" or "factory".
        source: the ``.onnx`` path, the ``.py`` path or the module name.
        function: the factory's name (factories only).
    """

    spec: str
    kind: str
    source: str
    function: str = ""


def parse_target(spec: str) -> Target:
    """Split a TARGET into an ONNX file or a factory (without importing anything).

    Example:
        >>> parse_target("models/resnet.py:make_model").function
        'make_model'
    """
    if spec.lower().endswith(".onnx"):
        if not Path(spec).is_file():
            raise CliError(f"{spec}: no such ONNX file")
        return Target(spec, "onnx", spec)
    if ":" in spec:
        source, _, function = spec.rpartition(":")
    elif spec.endswith(".py"):
        source, function = spec, "make_model"
    else:
        raise CliError(
            f"bad target {spec!r}: expect a .onnx file, path/to/file.py:function or "
            "package.module:function (a factory returning an nn.Module)")
    if not function.isidentifier():
        raise CliError(f"bad target {spec!r}: {function!r} is not a Python function name "
                       "(expected e.g. models/resnet.py:make_model)")
    if source.endswith(".py"):
        if not Path(source).is_file():
            raise CliError(f"{source}: no such file (target {spec!r})")
    elif not re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*", source):
        raise CliError(f"bad target {spec!r}: {source!r} is neither a .py file nor a module "
                       "name (expected path/to/file.py:function or package.module:function)")
    return Target(spec, "factory", source, function)


def parse_shape(text: str) -> tuple[int, ...]:
    """``"2,3,32,32"`` (or ``2x3x32x32``) -> ``(2, 3, 32, 32)``; ``""`` is a scalar.

    Example:
        >>> parse_shape("2,3,32,32")
        (2, 3, 32, 32)
    """
    parts = [p.strip() for p in re.split(r"[,x]", text.strip())] if text.strip() else []
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise CliError(f"bad --input-shape {text!r}: expected comma-separated positive "
                       "integers, e.g. --input-shape 2,3,32,32")
    return tuple(int(p) for p in parts)


def parse_dtype(text: str) -> str:
    """Canonical name of an ``--input-dtype`` value (``int64``, ``float32`` ...)."""
    name = INPUT_DTYPES.get(text.strip().lower())
    if name is None:
        raise CliError(f"bad --input-dtype {text!r}: choose one of "
                       f"{', '.join(sorted(set(INPUT_DTYPES.values())))}")
    return name


def parse_level(text: str) -> str:
    """``"o2"`` -> ``"O2"``; anything else but O0-O3 is an error."""
    level = text.strip().upper()
    if level not in LEVEL_NAMES:
        raise CliError(f"unknown level {text!r}: choose one of {', '.join(LEVEL_NAMES)}")
    return level


def parse_levels(text: str) -> list[str]:
    """``"O0,O1,O2"`` -> ``["O0", "O1", "O2"]``."""
    levels = [parse_level(p) for p in text.split(",") if p.strip()]
    if not levels:
        raise CliError(f"bad --levels {text!r}: expected e.g. O0,O1,O2")
    return levels


def load_module(target: Target) -> ModuleType:
    """Import the factory's file or module (the working directory is importable)."""
    if str(Path.cwd()) not in sys.path:
        sys.path.insert(0, str(Path.cwd()))
    try:
        if target.source.endswith(".py"):
            path = Path(target.source).resolve()
            name = "ampgraph_cli_" + re.sub(r"\W", "_", path.stem)
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            sys.path.insert(0, str(path.parent))
            writes = sys.dont_write_bytecode
            sys.dont_write_bytecode = True  # inspecting a file leaves no __pycache__ beside it
            try:
                spec.loader.exec_module(module)
            finally:
                sys.dont_write_bytecode = writes
            return module
        return importlib.import_module(target.source)
    except ModuleNotFoundError as exc:
        if target.source.endswith(".py") or exc.name != target.source.split(".")[0]:
            raise CliError(f"importing {target.source} failed: {one_line(exc)}") from exc
        raise CliError(f"no module named {target.source!r} (run from the directory that "
                       "contains it, or give path/to/file.py:function)") from exc
    except Exception as exc:
        raise CliError(f"importing {target.source} failed: {one_line(exc)}") from exc


def build_model(target: Target) -> tuple[Any, ModuleType]:
    """Call the factory; return (the nn.Module, its Python module)."""
    from torch import nn

    module = load_module(target)
    factory = getattr(module, target.function, None)
    if not callable(factory):
        names = sorted(n for n, v in vars(module).items()
                       if callable(v) and not n.startswith("_") and
                       getattr(v, "__module__", None) == module.__name__)
        raise CliError(f"{target.source} has no function {target.function!r}"
                       + (f" (it defines: {', '.join(names[:8])})" if names else ""))
    try:
        model = factory()
    except Exception as exc:
        raise CliError(f"building the model with {target.spec} failed: {one_line(exc)}") from exc
    if not isinstance(model, nn.Module):
        raise CliError(f"{target.spec} returned {type(model).__name__}, not a torch.nn.Module")
    return model, module


def make_inputs(module: ModuleType | None, shapes: list[tuple[int, ...]], dtypes: list[str],
                int_high: int = 2, seed: int = 0) -> tuple:
    """Positional inputs: random tensors of ``shapes``, else the module's ``example_inputs()``.

    Integer inputs are drawn from ``[0, int_high)`` (0/1 are valid token ids for any
    vocabulary and valid attention masks).
    """
    import torch

    if not shapes:
        if dtypes:
            raise CliError("--input-dtype needs --input-shape (one --input-shape per input)")
        fn = getattr(module, "example_inputs", None) if module is not None else None
        if not callable(fn):
            where = getattr(module, "__file__", None) or getattr(module, "__name__", "the target")
            raise CliError(f"no --input-shape given and {where} has no example_inputs(); "
                           "pass e.g. --input-shape 2,3,32,32")
        try:
            value = fn()
        except Exception as exc:
            raise CliError(f"example_inputs() failed: {one_line(exc)}") from exc
        value = (value,) if isinstance(value, torch.Tensor) else value
        if not isinstance(value, tuple | list):
            raise CliError(f"example_inputs() returned {type(value).__name__}: expected a "
                           "tensor or a tuple of positional inputs")
        return tuple(value)
    if len(dtypes) > 1 and len(dtypes) != len(shapes):
        raise CliError(f"{len(dtypes)} --input-dtype for {len(shapes)} --input-shape: give one "
                       "dtype for all inputs or one per input")
    per_input = dtypes if len(dtypes) > 1 else (dtypes or ["float32"]) * len(shapes)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for shape, name in zip(shapes, per_input):
        dtype = getattr(torch, name)
        if dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(dtype))
        else:
            high = 2 if dtype == torch.bool else int_high
            out.append(torch.randint(0, high, shape, generator=gen).to(dtype))
    return tuple(out)


def one_line(exc: BaseException) -> str:
    """``TypeName: first line of the message`` (at most 400 characters)."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")[:400]


@contextlib.contextmanager
def quiet(enabled: bool = True) -> Iterator[None]:
    """Hide what torch prints on stderr while capturing (a failed torch.export prints its
    partial graph), but keep the warnings: they are re-issued, once each, on exit."""
    if not enabled:
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    seen = set()
    for w in caught:
        key = (w.category, str(w.message))
        if key not in seen and not issubclass(w.category, DeprecationWarning | FutureWarning):
            seen.add(key)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
