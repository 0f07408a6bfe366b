"""Shared test helpers: load reference models, record executed aten ops, check passes."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODEL_NAMES = ("lenet5", "tabular_mlp", "resnet", "unet", "bert_encoder", "gpt_decoder")
LOW = (torch.bfloat16, torch.float16)

# aten ops as they reach the dispatcher (after CompositeImplicit decompositions).
MATMUL_OPS = {
    "addmm", "mm", "bmm", "baddbmm", "convolution", "matmul", "linear",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
    "attention",  # ampgraph::attention, the unfused CPU attention (ampgraph.runtime.cpu.attention)
    "_linear_pointwise",  # oneDNN's linear on a packed weight (ampgraph.runtime.cpu.packed)
}
NORM_OPS = {
    "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_functional",
    "_native_batch_norm_legit_no_training", "native_layer_norm", "cudnn_batch_norm",
}
SOFTMAX_OPS = {"_softmax", "_log_softmax"}


def load_model_file(name: str) -> Any:
    """Import models/<name>.py by path (models/ is not a package)."""
    path = ROOT / "models" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"ampgraph_models_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def make(name: str, batch_size: int = 2, seed: int = 0, **overrides: Any):
    """(model, example_inputs) of a reference model, deterministic."""
    mod = load_model_file(name)
    torch.manual_seed(seed)
    model = mod.make_model(**overrides)
    return model, mod.example_inputs(batch_size)


class OpRecorder(TorchDispatchMode):
    """Logs every aten op executed with the dtypes of its tensor inputs."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, list[torch.dtype]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves = tree_flatten((args, kwargs))[0]
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        if any(isinstance(t, FakeTensor) for t in tensors):  # capture-time tracing, not a run
            return func(*args, **kwargs)
        dtypes = [t.dtype for t in tensors]
        self.calls.append((func.overloadpacket.__name__, dtypes))
        return func(*args, **kwargs)

    def inputs_of(self, names: set[str]) -> list[tuple[str, list[torch.dtype]]]:
        return [(n, d) for n, d in self.calls if n in names]

    def first_input_dtypes(self, names: set[str]) -> set[torch.dtype]:
        return {d[0] for n, d in self.calls if n in names and d}

    def norm_compute_dtypes(self) -> set[torch.dtype]:
        """The precision each norm computes in: fp32 when it has fp32 weights or statistics
        (PyTorch's kernels then widen a 16-bit input on load and round once on store, what
        ampgraph's norm cast fusion relies on), else its input's dtype."""
        return {torch.float32 if torch.float32 in d else d[0]
                for n, d in self.calls if n in NORM_OPS and d}

    def any_low(self) -> bool:
        return any(dt in LOW for _, d in self.calls for dt in d)


def record(fn: Callable[[], Any]) -> tuple[Any, OpRecorder]:
    rec = OpRecorder()
    with rec:
        out = fn()
    return out, rec


def first_tensor(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    leaves = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    return leaves[0]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().flatten(), b.detach().double().flatten()
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


class Keyworded(torch.nn.Module):
    """A forward with keyword and keyword-only parameters (what trainers pass)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.norm = torch.nn.LayerNorm(8)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor | None = None, *, scale=1.0):
        return self.norm(self.fc(input_ids)) * scale


def global_state() -> tuple:
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype(), torch.is_autocast_enabled("cpu"),
            torch.get_autocast_dtype("cpu"), torch.is_autocast_enabled("cuda"),
            torch.get_autocast_dtype("cuda"), torch.is_autocast_cache_enabled())


def call(model, inputs):
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


class SyncCounter(TorchDispatchMode):
    """Counts host syncs: aten._local_scalar_dense (.item(), bool(tensor), float(tensor))."""

    def __init__(self) -> None:
        super().__init__()
        self.syncs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.syncs += 1
        return func(*args, **(kwargs or {}))
