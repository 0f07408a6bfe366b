"""AmpModule: the module ``ampgraph.compile`` returns.

It shares its parameter, buffer and submodule dicts with the user's model, so
``parameters()``, ``state_dict()``, ``.to()`` and optimizers see the user's fp32 master
weights under the user's names. ``forward`` runs a captured, cast-rewritten graph chosen
by (train/eval mode, input structure), capturing again when either changes. A model that
cannot be exported whole runs its own code eagerly in fp32 with each child compiled on
its own (recursively), and ``explain`` says which parts stayed eager and why.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from ampgraph.capture import (
    Captured,
    direct_runner,
    export_module,
    flatten_inputs,
    preserved_global_state,
    share_state,
    signature_of,
)
from ampgraph.capture.state import AUTOCAST_DEVICES
from ampgraph.config import AmpConfig, dtype_name, model_device, runtime_name
from ampgraph.runtime import Runtime, make_runtime
from ampgraph.signature import SignedForward, signed_forward
from passes.fx import run_amp_passes
from passes.fx.dtypes import dtype_of
from passes.fx.nodes import module_info, op_key
from passes.policy import FP32, LOW, NA

MAX_GRAPHS_PER_SIGNATURE = 8
MAX_REFUSED_SHAPES = 1024  # input shapes export refused, remembered so as not to retry

# Methods of the wrapped model that call ``self(...)`` (HuggingFace ``generate``): run on
# a stand-in of the model whose forward is the compiled one, see :func:`_call_routed`.
ROUTED_METHODS = frozenset({"generate"})


def _autocast_on() -> bool:
    return any(torch.is_autocast_enabled(d) for d in AUTOCAST_DEVICES)


def _autocast_off() -> contextlib.ExitStack:
    """Disable autocast on every device where it is on (Accelerate, Lightning, HF Trainer
    wrap forward in it); the graph keeps its fp32 ops fp32 and capture sees no autocast."""
    stack = contextlib.ExitStack()
    for device in AUTOCAST_DEVICES:
        if torch.is_autocast_enabled(device):
            stack.enter_context(torch.autocast(device, enabled=False))
    return stack


@dataclass
class Compiled:
    """A captured graph after the AMP passes, with its decisions for ``explain``."""

    captured: Captured
    decisions: dict
    casts: int
    runner: Any = None  # what forward calls: the graph module, or torch.compile of it

    @property
    def gm(self) -> fx.GraphModule:
        return self.captured.gm


@dataclass
class EagerPart:
    """A module that could not be captured and runs its own code eagerly in fp32."""

    path: str
    module_type: str
    reason: str


class AmpModule(nn.Module):
    """A model rewritten for mixed precision; see :func:`ampgraph.compile`."""

    def __init__(self, model: nn.Module, config: AmpConfig, low: torch.dtype, path: str = ""):
        super().__init__()
        share_state(self, model)
        self.__dict__.update(
            _amp_model=model, amp_config=config, amp_dtype=low, _amp_path=path,
            _amp_graphs=OrderedDict(), _amp_lock=threading.RLock(), _amp_eager=None,
            _amp_eager_reason=None, _amp_last=None, _amp_runtime=None,
            _amp_transforms=[], _amp_refused=set(),
            _amp_forward=signed_forward(model, AmpModule._run),
        )
        self._amp_policy = config.policy(low)

    # -- nn.Module plumbing -------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_amp_model")
            if model is None:
                raise
            attr = getattr(model, name)
            if name in ROUTED_METHODS and getattr(attr, "__self__", None) is model:
                return functools.partial(_call_routed, self, name)
            return attr

    @property
    def training(self) -> bool:
        """The user's model's flag: ``model.eval()`` switches the compiled module too."""
        model = self.__dict__.get("_amp_model")
        return self.__dict__.get("_amp_training", True) if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_amp_model")
        if model is None:  # nn.Module.__init__, before the model is attached
            self.__dict__["_amp_training"] = mode
        else:
            model.training = mode

    def train(self, mode: bool = True) -> AmpModule:
        super().train(mode)
        self._amp_model.train(mode)
        if self._amp_eager is not None:
            self._amp_eager.train(mode)
        return self

    def extra_repr(self) -> str:
        cfg = self.amp_config
        return (f"level={cfg.amp_level}, dtype={dtype_name(self.amp_dtype)}, "
                f"model={type(self._amp_model).__name__}")

    def working_copies(self) -> list[torch.Tensor]:
        """The low-precision training copies of the weights this module keeps between steps
        (what counts beside parameters, gradients and optimizer state in memory budgets).

        Example:
            >>> sum(t.numel() * t.element_size() for t in net.working_copies())  # doctest: +SKIP
        """
        runtime = self._amp_runtime
        copies = runtime.working_copies() if runtime is not None else []
        if self._amp_eager is not None:
            for child in _amp_children(self._amp_eager):
                copies += child.working_copies()
        return copies

    def clear_weight_cache(self) -> None:
        """Drop the weights' low-precision copies (after ``p.data`` edits) and kept outputs."""
        if self._amp_runtime is not None:
            self._amp_runtime.clear()
        if self._amp_eager is not None:
            for child in _amp_children(self._amp_eager):
                child.clear_weight_cache()

    def __deepcopy__(self, memo: dict) -> AmpModule:
        return AmpModule(copy.deepcopy(self._amp_model, memo), self.amp_config, self.amp_dtype,
                         self._amp_path).train(self.training)

    @property
    def original_module(self) -> nn.Module:
        """The user's module (shares all parameters with this one)."""
        return self._amp_model

    def add_graph_transform(self, transform: Any) -> None:
        """Run ``transform(gm)`` on every captured graph, now and after each new capture.

        For training machinery that rewrites the compiled graph (per-layer loss scaling
        inserts its gradient-scale ops this way). Submodules that fell back to eager
        execution are not transformed.

        Example:
            >>> net.add_graph_transform(lambda gm: None)  # doctest: +SKIP
        """
        with self._amp_lock:
            self._amp_transforms.append(transform)
            for graphs in self._amp_graphs.values():
                for compiled in graphs:
                    transform(compiled.captured.gm)
                    if self.amp_config.backend is None:  # a new graph, maybe submodules
                        compiled.runner = direct_runner(compiled.captured.gm)

    # -- execution ------------------------------------------------------------------------

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if _autocast_on():  # the graph's casts are the precision: autocast must not re-cast
            with _autocast_off():
                return self._run(*args, **kwargs)
        compiled = self._compiled_for(args, kwargs)
        if compiled is None:  # eager for good, or for these input shapes (_compiled_for)
            eager = self._amp_eager
            return (eager if eager is not None else self._amp_model)(*args, **kwargs)
        flat = compiled.runner(tuple(args), dict(kwargs))
        return compiled.captured.rebuild(flat, args, kwargs)

    forward = SignedForward(_run)

    def _compiled_for(self, args: tuple, kwargs: dict) -> Compiled | None:
        with self._amp_lock:
            if self._amp_eager is not None:
                return None
            try:
                leaves, spec = flatten_inputs(args, kwargs)
            except Exception as exc:  # e.g. a cache whose layer types its flatten refuses
                self._go_eager(f"inputs cannot be flattened: {_first_line(exc)}")
                return None
            key = (self.training, signature_of(leaves, spec))
            graphs = self._amp_graphs.setdefault(key, [])
            for compiled in graphs:
                if compiled.captured.accepts_leaves(leaves):
                    self.__dict__["_amp_last"] = compiled
                    return compiled
            # other shapes of this structure captured: these ones alone run eagerly if
            # export refuses them (e.g. sizes the model itself rejects), not every call
            shapes = (key, tuple(t.shape for t in leaves if isinstance(t, torch.Tensor)))
            if shapes in self._amp_refused:
                return None
            compiled = self._capture(args, kwargs, first=not graphs)
            if compiled is None:
                if graphs and len(self._amp_refused) < MAX_REFUSED_SHAPES:
                    self._amp_refused.add(shapes)
                return None
            graphs.insert(0, compiled)
            del graphs[MAX_GRAPHS_PER_SIGNATURE:]
            self.__dict__["_amp_last"] = compiled
            return compiled

    def _capture(self, args: tuple, kwargs: dict, first: bool = True) -> Compiled | None:
        # export and the passes both trace or re-run the model's ops; neither may leave
        # grad mode, autocast, inference mode, the default dtype or the RNG changed
        with preserved_global_state():
            return self._capture_unguarded(args, kwargs, first)

    def _capture_unguarded(self, args: tuple, kwargs: dict, first: bool) -> Compiled | None:
        model = self._amp_model
        model.train(self.training)
        try:
            captured = export_module(model, args, kwargs)
        except Exception as exc:  # untraceable code: compile the children on their own
            if first:
                self._go_eager(f"torch.export failed: {_first_line(exc)}")
            else:
                warnings.warn(f"ampgraph: {self._amp_path or type(model).__name__} could not be "
                              f"captured for these input shapes ({_first_line(exc)}); calls "
                              "with them run eagerly in fp32", UserWarning, stacklevel=5)
            return None
        backend = self.amp_config.backend
        try:
            result = run_amp_passes(captured.gm, self._amp_policy, self.amp_dtype,
                                    keep_io_types=self.amp_config.keep_io_types,
                                    runtime=self._runtime_for(model).ops(backend))
        except Exception as exc:
            self._go_eager(f"ampgraph pass failed: {_first_line(exc)}")
            return None
        if self.amp_config.amp_level != "O0" and not any(
                d.precision != NA for d in result.decisions.values() if d.cls):
            warnings.warn(
                f"ampgraph: {self._amp_path or type(model).__name__} has no floating-point ops; "
                "compiling it changes nothing", UserWarning, stacklevel=4)
        for transform in self._amp_transforms:
            transform(captured.gm)
        if backend is None:
            runner = direct_runner(captured.gm)
        else:  # hand the rewritten aten graph to torch.compile
            runner = torch.compile(captured.gm, backend=backend, dynamic=True)
        return Compiled(captured, result.decisions, result.casts, runner)

    def _runtime_for(self, model: nn.Module) -> Runtime:
        """The runtime the resolved configuration names for the model's device now (made
        once; again if the model moved to a device with another runtime)."""
        name = runtime_name(self.amp_config, model_device(model))
        runtime = self._amp_runtime
        if runtime is None or runtime.name != name:
            runtime = self.__dict__["_amp_runtime"] = make_runtime(name)
        return runtime

    def _go_eager(self, reason: str) -> None:
        model = self._amp_model
        where = self._amp_path or type(model).__name__
        warnings.warn(
            f"ampgraph: {where} could not be captured whole ({reason}); its own code runs "
            "eagerly in fp32 and each submodule is compiled separately. "
            "ampgraph.explain(model) lists what stayed eager.",
            UserWarning,
            stacklevel=4,
        )
        self.__dict__["_amp_eager_reason"] = reason
        self.__dict__["_amp_eager"] = eager_plan(model, self.amp_config, self.amp_dtype,
                                                  self._amp_path, self._amp_policy)

    # -- reporting ------------------------------------------------------------------------

    def amp_parts(self) -> tuple[list[tuple[str, Compiled]], list[EagerPart]]:
        """What the last run executed: (compiled graphs with their module prefix, eager parts).

        The graphs are those of the last call (per submodule when the model fell back);
        ``explain`` and ``ampgraph inspect`` read them.

        Example:
            >>> graphs, eager = net.amp_parts()
            >>> [prefix for prefix, _ in graphs], [e.path for e in eager]
            ([''], [])
        """
        if self._amp_eager is None:
            last = self._amp_last
            return ([(self._amp_path, last)] if last is not None else []), []
        graphs: list[tuple[str, Compiled]] = []
        eager = [EagerPart(self._amp_path or "<root>", type(self._amp_model).__name__,
                           self._amp_eager_reason or "")]
        for sub in _amp_children(self._amp_eager):
            g, e = sub.amp_parts()
            graphs += g
            eager += e
        return graphs, eager


def _call_routed(amp: AmpModule, name: str, *args: Any, **kwargs: Any) -> Any:
    """``amp._amp_model.<name>(*args, **kwargs)`` with every ``self(...)`` and
    ``self.forward(...)`` inside it running ``amp``'s compiled graphs.

    HuggingFace's ``generate`` calls the model object it is bound to, so calling it on the
    wrapped model would run the fp32 model. It runs instead on a stand-in: an instance of
    a subclass of the model's class (so ``isinstance`` and ``super()`` hold) whose
    ``forward`` is ``amp`` and keeps the model's signature, with a copy of the model's
    ``__dict__`` (the same parameters, submodules, config and generation config). The
    model's own object is not touched while it runs (other threads may call it); plain
    attributes the method set on the stand-in are copied back to the model after it.
    """
    model = amp._amp_model
    stand_in = object.__new__(_routed_class(type(model)))
    state = model.__dict__
    stand_in.__dict__.update(state)
    stand_in.__dict__["_amp_route"] = amp
    try:
        return getattr(stand_in, name)(*args, **kwargs)
    finally:
        for key, value in stand_in.__dict__.items():
            if key != "_amp_route" and state.get(key, _MISSING) is not value:
                state[key] = value


_MISSING = object()
_ROUTED_CLASSES: dict[type, type] = {}


def _routed_class(cls: type) -> type:
    routed = _ROUTED_CLASSES.get(cls)
    if routed is None:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            return self.__dict__["_amp_route"](*args, **kwargs)

        functools.update_wrapper(forward, cls.forward)  # HF inspects forward's parameters
        routed = _ROUTED_CLASSES[cls] = type(cls.__name__, (cls,), {
            "forward": forward, "__module__": cls.__module__,
            "__qualname__": cls.__qualname__})
    return routed


def _amp_children(module: nn.Module) -> list[AmpModule]:
    out = []
    for child in module.children():
        if isinstance(child, AmpModule):
            out.append(child)
        else:
            out += _amp_children(child)
    return out


def eager_plan(model: nn.Module, config: AmpConfig, low: torch.dtype, path: str,
               policy: Any) -> nn.Module:
    """A shallow copy of ``model`` whose children are compiled on their own.

    Containers without a forward of their own (ModuleList, ModuleDict) are copied the
    same way; a module without children runs as it is, in fp32.
    """
    plan = copy.copy(model)
    children = OrderedDict()
    for name, child in model._modules.items():
        sub = f"{path}.{name}" if path else name
        if child is None:
            children[name] = None
        elif type(child).forward is nn.Module.forward:
            children[name] = eager_plan(child, config, low, sub, policy)
        else:
            children[name] = AmpModule(child, config, low, sub)
            children[name].__dict__["_amp_policy"] = policy
    plan.__dict__["_modules"] = children
    return plan


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def node_rows(prefix: str, compiled: Compiled, low: torch.dtype) -> list[dict[str, str]]:
    """One row per original graph node: name, op, module, precision, reason."""
    rows = []
    for node in compiled.gm.graph.nodes:
        if node.op in ("output", "call_module") or node.meta.get("amp_cast"):
            continue
        decision = compiled.decisions.get(node.name)
        path, _ = module_info(node)
        if node.op == "get_attr":
            path = node.target.rpartition(".")[0]
        module = ".".join(p for p in (prefix, path) if p)
        # meta starts as the painter's decision; later passes (norm cast fusion) amend it
        precision = node.meta.get("amp_precision", decision.precision if decision else NA)
        reason = node.meta.get("amp_reason", decision.reason if decision else "")
        if precision == LOW:
            precision = dtype_name(low)
        elif precision == NA and decision is not None:
            now = dtype_of(node)
            if now in (torch.float32, torch.float16, torch.bfloat16):
                precision = dtype_name(now)
        elif precision == FP32:
            precision = "fp32"
        op = node.meta.get("amp_orig_op") or op_key(node)  # a fused op shows what it runs
        rows.append({"name": node.name, "op": op if node.op == "call_function" else node.op,
                     "module": module, "precision": precision, "reason": reason})
    return rows
