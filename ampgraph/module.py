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
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import fx, nn

from ampgraph.capture import (
    Captured,
    UnsupportedInput,
    direct_runner,
    export_module,
    flatten_inputs,
    preserved_global_state,
    repoint_state,
    share_state,
    signature_of,
)
from ampgraph.capture.export import StateNotCapturable
from ampgraph.capture.fallback import EagerPart, EagerPlan, compiled_children
from ampgraph.capture.generate import route_method
from ampgraph.capture.guards import Recaptures
from ampgraph.capture.hooks import ModuleCall, call_with_hooks, forward_of, has_untraced_hooks
from ampgraph.capture.numbers import Numbers, as_tensors, given_as_tensors, number_positions
from ampgraph.capture.opaque import OpaqueCall, bind_opaque_calls, release
from ampgraph.capture.side_effects import SideEffect
from ampgraph.capture.state import AUTOCAST_DEVICES
from ampgraph.compiled_class import compiled_class
from ampgraph.config import AmpConfig, ResolvedConfig, dtype_name, model_device
from ampgraph.runtime import Runtime, compiled_runner, make_runtime
from ampgraph.signature import SignedForward, signed_forward
from passes.fx import run_amp_passes
from passes.fx.calibration import observe_magnitudes, overflowing
from passes.policy import NA, LevelPolicy

MAX_GRAPHS_PER_SIGNATURE = 8
MAX_REFUSED_SHAPES = 1024  # input shapes export refused, remembered so as not to retry


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
class CaptureFailure:
    """A capture that failed, not acted on yet: when the eager model takes the same inputs,
    :meth:`commit` makes the module fall back (the first capture of an input structure,
    or a pass failure: for good) or run those input shapes eagerly, and says why."""

    net: AmpModule
    reason: str  # for explain, when the module falls back
    short: str = ""  # for the warning, when only these input shapes run eagerly
    whole: bool = False  # a pass failed: the module falls back whatever the inputs
    first: bool = True  # no graph of this input structure yet
    shapes: tuple = ()  # (key, input shapes) refused when not first

    def commit(self) -> None:
        net = self.net
        with net._amp_lock:
            if net._amp_eager is not None:
                return
            if self.first or self.whole:
                net._go_eager(self.reason)
                return
            if len(net._amp_refused) < MAX_REFUSED_SHAPES:
                net._amp_refused.add(self.shapes)
        warnings.warn(f"ampgraph: {net._amp_path or type(net._amp_model).__name__} could not "
                      f"be captured for these input shapes ({self.short}); calls with them run "
                      "eagerly in fp32", UserWarning, stacklevel=5)


@dataclass
class Compiled:
    """A captured graph after the AMP passes, with its decisions for ``explain``."""

    captured: Captured
    decisions: dict
    casts: int
    runner: Any = None  # what forward calls: the graph's code, or its compiled_runner
    opaque: list = field(default_factory=list)  # its calls kept out of the graph, bound
    ran: bool = False  # it ran once: a later error is not one of the inputs it was made for

    @property
    def gm(self) -> fx.GraphModule:
        return self.captured.gm


class AmpModule(nn.Module):
    """A model rewritten for mixed precision; see :func:`ampgraph.compile`.

    The model and the eager plan must not become children (``_modules`` is the model's own
    dict: the model would sit inside itself): they, and each call's graph (``_amp_last``),
    are set with ``object.__setattr__``. ``AmpModule(model, ...)`` is an instance of
    ``compiled_class(AmpModule, type(model))``: named like the model's class, with its
    ``forward`` signature (a ``PreTrainedModel`` when the model is one).
    """

    amp_resolved: ResolvedConfig  # level, dtype, device and runtime, resolved once
    amp_config: AmpConfig
    amp_dtype: torch.dtype  # the low dtype the graphs compute in
    _amp_model: nn.Module  # the user's model (not registered, see above)
    _amp_path: str  # this module's path in the model compiled first ("" at the root)
    _amp_policy: LevelPolicy  # the painter's policy (shared by the eager plan's children)
    _amp_graphs: OrderedDict[tuple, list[Compiled]]  # (training, input signature) -> graphs
    _amp_lock: threading.RLock  # guards the graphs, the refused shapes and going eager
    _amp_eager: nn.Module | None  # the eager plan once export failed (not registered)
    _amp_eager_reason: str | None  # why export failed, for ``explain``
    _amp_last: Compiled | None  # the graph of the last call
    _amp_runtime: Runtime | None  # made for the model's device on the first capture
    _amp_transforms: list[Callable[[fx.GraphModule], Any]]  # see add_graph_transform
    _amp_refused: set[tuple]  # (key, input shapes) export refused: these run eagerly
    _amp_recaptures: Recaptures  # captures again because guards failed, per input structure
    _amp_numbers: dict[tuple, Numbers]  # per input structure less numbers: what they did
    _amp_forward: Callable[..., Any] | None  # forward with the model's signature
    _amp_training: bool  # the mode nn.Module.__init__ sets, before the model is attached

    def __new__(cls, *args: Any, **kwargs: Any) -> AmpModule:
        model = args[0] if args else kwargs.get("model")
        if cls is AmpModule and model is not None:  # the model class's compiled class
            cls = compiled_class(AmpModule, type(model))
        return super().__new__(cls)

    def __init__(self, model: nn.Module, config: ResolvedConfig, path: str = ""):
        nn.Module.__init__(self)  # not super(): PreTrainedModel may follow in the MRO
        share_state(self, model)
        object.__setattr__(self, "_amp_model", model)  # not a child: see the class docstring
        self.amp_resolved = config
        self.amp_config = config.config
        self.amp_dtype = config.dtype
        self._amp_path = path
        self._amp_policy = config.policy().under(path)
        self._amp_graphs = OrderedDict()
        self._amp_lock = threading.RLock()
        object.__setattr__(self, "_amp_eager", None)
        self._amp_eager_reason = None
        object.__setattr__(self, "_amp_last", None)
        self._amp_runtime = None
        self._amp_transforms = []
        self._amp_refused = set()
        self._amp_recaptures = Recaptures(path or "the model")
        self._amp_numbers = {}
        self._amp_forward = signed_forward(model, AmpModule._run)

    # -- nn.Module plumbing -------------------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_amp_model")
            if model is None:
                raise
            return route_method(self, model, name, getattr(model, name))  # HF generate

    @property
    def training(self) -> bool:
        """The user's model's flag: ``model.eval()`` switches the compiled module too."""
        model = self.__dict__.get("_amp_model")
        return self.__dict__.get("_amp_training", True) if model is None else model.training

    @training.setter
    def training(self, mode: bool) -> None:
        model = self.__dict__.get("_amp_model")
        if model is None:  # nn.Module.__init__, before its dicts and the model exist
            object.__setattr__(self, "_amp_training", mode)
        else:
            model.training = mode

    def train(self, mode: bool = True) -> AmpModule:
        super().train(mode)
        self._amp_model.train(mode)
        return self

    def extra_repr(self) -> str:
        cfg = self.amp_config
        return (f"level={cfg.amp_level}, dtype={dtype_name(self.amp_dtype)}, "
                f"model={type(self._amp_model).__name__}")

    def working_copies(self) -> list[torch.Tensor]:
        """The low-precision training copies of the weights kept between steps (memory).

        Example:
            >>> sum(t.numel() * t.element_size() for t in net.working_copies())  # doctest: +SKIP
        """
        runtime = self._amp_runtime
        copies = runtime.working_copies() if runtime is not None else []
        for child in self._parts():
            copies += child.working_copies()
        return copies

    def clear_weight_cache(self) -> None:
        """Drop the weights' low-precision copies (after ``p.data`` edits) and kept outputs."""
        if self._amp_runtime is not None:
            self._amp_runtime.clear()
        for child in self._parts():
            child.clear_weight_cache()

    def mark_weights_stale(self) -> None:
        """Make the next call write every kept low-precision copy again from its master, in
        place where nothing else holds it (a CUDA graph then records the refresh)."""
        if self._amp_runtime is not None:
            self._amp_runtime.invalidate()
        for child in self._parts():
            child.mark_weights_stale()

    def _parts(self, last_only: bool = False) -> list[AmpModule]:
        """The compiled modules this one runs besides its own graphs: its eager plan's
        children, and the submodules its graphs (or only the last call's) cut out."""
        if self._amp_eager is not None:
            return compiled_children(self._amp_eager, AmpModule)
        graphs = [self._amp_last] if last_only else [
            c for cs in self._amp_graphs.values() for c in cs]
        return [call.runner for c in graphs if c is not None for call in c.opaque
                if isinstance(call, ModuleCall) and call.runner is not None]

    def __deepcopy__(self, memo: dict) -> AmpModule:
        return AmpModule(copy.deepcopy(self._amp_model, memo), self.amp_resolved,
                         self._amp_path).train(self.training)

    @property
    def original_module(self) -> nn.Module:
        """The user's module (shares all parameters with this one)."""
        return self._amp_model

    def add_graph_transform(self, transform: Any) -> None:
        """Run ``transform(gm)`` on every captured graph, now and after each new capture.

        For training machinery that rewrites the graph (per-layer loss scaling); submodules
        that fell back to eager execution are not transformed.

        Example:
            >>> net.add_graph_transform(lambda gm: None)  # doctest: +SKIP
        """
        with self._amp_lock:
            self._amp_transforms.append(transform)
            for graphs in self._amp_graphs.values():
                for compiled in graphs:
                    transform(compiled.captured.gm)
                    compiled.runner = self._runner(compiled.captured.gm)  # a new graph

    def drop_graphs(self) -> None:
        """Forget every captured graph, this module's and its compiled submodules' when it
        fell back to eager execution: the next call captures again (after the parameters
        changed dtype). ``amp_parts`` reports the last call's graph until then.

        Example:
            >>> net.drop_graphs()  # doctest: +SKIP
        """
        with self._amp_lock:
            children = self._parts()
            self._amp_graphs.clear()
            self._amp_recaptures.clear()
            self._amp_numbers.clear()
            for child in children:
                child.drop_graphs()

    def calibrate(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        """Run the captured graph in fp32 on sample inputs; from the next call on, keep fp32
        the ops whose values exceeded fp16's range there (docs/levels.md): key -> reason.

        Example:
            >>> net.calibrate(latents)  # doctest: +SKIP
        """
        with self._amp_lock, preserved_global_state():
            gm = export_module(self._amp_model, args, kwargs).gm
            found = overflowing(observe_magnitudes(gm, args, kwargs), self.amp_dtype)
            calibrated = {**dict(self._amp_policy.calibrated), **found}
            self._amp_policy = replace(self._amp_policy, calibrated=tuple(calibrated.items()))
            self.drop_graphs()
        return found

    # -- execution ------------------------------------------------------------------------

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # under torch.compile(net): the graphs stay ours
            return _outside_dynamo()(self, *args, **kwargs)
        if _autocast_on():  # the graph's casts are the precision: autocast must not re-cast
            with _autocast_off():
                return self._run(*args, **kwargs)
        return self._run_hooked(*args, **kwargs)

    def _run_hooked(self, *args: Any, **kwargs: Any) -> Any:
        model = self._amp_model
        if has_untraced_hooks(model):  # the user's model's own hooks, around the graph
            return call_with_hooks(model, self._run_graph, args, kwargs)
        return self._run_graph(*args, **kwargs)

    def _run_graph(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self._select(args, kwargs)
        if isinstance(compiled, CaptureFailure):
            out = forward_of(self._amp_model)(*args, **kwargs)  # the user's error raises here
            compiled.commit()  # eager took the inputs: the model cannot be captured for them
            return out
        if compiled is None:  # eager for good, or for these inputs (compiled_for)
            if self._amp_eager is not None:
                return self._amp_eager(*args, **kwargs)
            return forward_of(self._amp_model)(*args, **kwargs)
        given = (args, kwargs) if not compiled.captured.numbers else as_tensors(
            args, kwargs, compiled.captured.numbers)
        try:
            flat = compiled.runner(tuple(given[0]), dict(given[1]))
        except Exception as exc:  # the user's error, in eager's words, if eager rejects them too
            if not compiled.ran:  # a graph captured for inputs nothing can run is dropped
                self._forget(compiled)
            _raise_eager_error(self._amp_model, args, kwargs, exc)
            raise
        compiled.ran = True
        return compiled.captured.rebuild(flat, args, kwargs)

    def _forget(self, compiled: Compiled) -> None:
        with self._amp_lock:
            for key, graphs in list(self._amp_graphs.items()):
                if compiled in graphs:
                    graphs.remove(compiled)
                    if not graphs:
                        del self._amp_graphs[key]

    forward = SignedForward(_run)

    def compiled_for(self, args: tuple, kwargs: dict) -> Compiled | None:
        """The graph that runs ``forward(*args, **kwargs)``, captured now if none of this
        mode and input structure accepts these inputs in the model's present state (its
        guards: ``capture/guards.py``); None when they run eagerly (the module fell back
        whole, export refused these input shapes, or the state it reads kept changing).

        Example:
            >>> net.compiled_for((torch.randn(8, 64),), {}).casts  # doctest: +SKIP
            4
        """
        found = self._select(args, kwargs)
        if isinstance(found, CaptureFailure):
            found.commit()
            return None
        return found

    def _select(self, args: tuple, kwargs: dict) -> Compiled | CaptureFailure | None:
        """:meth:`compiled_for`, a failed capture returned uncommitted: ``forward`` runs the
        eager model first, and an input it rejects too is the user's error, not a reason
        to give up on the model (``CaptureFailure``)."""
        with self._amp_lock:
            if self._amp_eager is not None:
                return None
            try:
                leaves, spec = flatten_inputs(args, kwargs)
            except Exception as exc:  # e.g. a cache whose layer types its flatten refuses
                self._go_eager(f"inputs cannot be flattened: {_first_line(exc)}")
                return None
            numbers = self._numbers(leaves, spec)
            sym = tuple(sorted(numbers.symbolic)) if numbers else ()
            found = self._cached(leaves, spec, sym)
            if found is not False:
                return found
            if numbers is not None and numbers.note(leaves):  # a number took a new value
                tried = tuple(sorted(numbers.symbolic))
                found = self._cached(leaves, spec, tried)
                if found is not False:
                    return found
                compiled = self._capture_for(args, kwargs, leaves, spec, tried)
                if not isinstance(compiled, CaptureFailure):
                    return compiled
                numbers.refuse(frozenset(tried) - frozenset(sym))  # it stays a constant
            if numbers is not None and not numbers.constant_capture(
                    self._amp_path or "the model", leaves, spec):
                return None
            return self._capture_for(args, kwargs, leaves, spec, sym)

    def _numbers(self, leaves: list, spec: Any) -> Numbers | None:
        """What this input structure's number arguments did (None: it takes none)."""
        positions = number_positions(leaves)
        if not positions:
            return None
        key = (self.training, signature_of(leaves, spec, positions))
        numbers = self._amp_numbers.get(key)
        if numbers is None:
            numbers = self._amp_numbers[key] = Numbers()
        return numbers

    def _cached(self, leaves: list, spec: Any, sym: tuple) -> Compiled | None | bool:
        """The cached graph that takes these inputs (the numbers at ``sym`` as inputs) in
        the model's present state; None: run eagerly; False: none, capture one."""
        key = (self.training, signature_of(leaves, spec, sym))
        graphs = self._amp_graphs.get(key, ())
        given = given_as_tensors(leaves, sym)
        stale = None
        for compiled in graphs:
            if compiled.captured.accepts_leaves(given):
                state = compiled.captured.state
                if state is None or state.check():
                    if stale is not None:  # the state went back to this graph's
                        self._state_changed(graphs, compiled)
                    object.__setattr__(self, "_amp_last", compiled)
                    return compiled
                stale = stale or compiled
        if stale is not None:
            state = stale.captured.state
            if state.take(lambda: repoint_state(stale.captured.gm, self._amp_model)):
                object.__setattr__(self, "_amp_last", stale)
                return stale
            if self._amp_recaptures.exhausted(key, state.changes()):
                return None
            self._state_changed(graphs, None)
        # other shapes of this structure captured: only these run eagerly if refused
        if (key, _shapes(leaves)) in self._amp_refused:
            return None
        return False

    def _state_changed(self, graphs: list, now: Compiled | None) -> None:
        """The model's state is no longer the last graph's: ``now`` (a graph whose state it
        is again, or None: one is captured) goes first, and the kept weight copies are
        dropped (the weights may have changed through ``.data`` too, which no version
        counter shows: PEFT's ``merge_adapter``)."""
        if now is not None:
            graphs.remove(now)
            graphs.insert(0, now)
        if self._amp_runtime is not None:
            self._amp_runtime.clear()

    def _capture_for(self, args: tuple, kwargs: dict, leaves: list, spec: Any,
                     sym: tuple) -> Compiled | CaptureFailure:
        key = (self.training, signature_of(leaves, spec, sym))
        graphs = self._amp_graphs.setdefault(key, [])
        compiled = self._capture(args, kwargs, sym)
        if isinstance(compiled, CaptureFailure):
            if not graphs:
                del self._amp_graphs[key]
            compiled.first, compiled.shapes = not graphs, (key, _shapes(leaves))
            return compiled
        graphs.insert(0, compiled)
        del graphs[MAX_GRAPHS_PER_SIGNATURE:]
        object.__setattr__(self, "_amp_last", compiled)
        return compiled

    def _capture(self, args: tuple, kwargs: dict, numbers: tuple = ()
                 ) -> Compiled | CaptureFailure:
        # export and the passes leave grad/inference mode, autocast, dtype, RNG as they were
        with preserved_global_state():
            return self._capture_unguarded(args, kwargs, numbers)

    def _capture_unguarded(self, args: tuple, kwargs: dict, numbers: tuple
                           ) -> Compiled | CaptureFailure:
        model = self._amp_model
        try:
            captured = export_module(model, args, kwargs, self._amp_path or "model", numbers)
        except Exception as exc:  # untraceable code: compile the children on their own
            reason = (f"input not capturable: {exc}" if isinstance(exc, UnsupportedInput)
                      else str(exc) if isinstance(exc, (SideEffect, StateNotCapturable))
                      else f"torch.export failed: {_first_line(exc)}")
            return CaptureFailure(self, reason, _first_line(exc))
        try:
            result = run_amp_passes(captured.gm, self._amp_policy, self.amp_dtype,
                                    keep_io_types=self.amp_config.keep_io_types,
                                    runtime=self._runtime_for(model).ops(self.amp_config.backend),
                                    fp8=self.amp_config.fp8)
            opaque = bind_opaque_calls(captured.gm, self._prepare_opaque)
        except Exception as exc:
            release(captured.opaque_keys)
            return CaptureFailure(self, f"ampgraph pass failed: {_first_line(exc)}", whole=True)
        if self.amp_config.amp_level != "O0" and not any(
                d.precision != NA for d in result.decisions.values() if d.cls):
            warnings.warn(
                f"ampgraph: {self._amp_path or type(model).__name__} has no floating-point ops; "
                "compiling it changes nothing", UserWarning, stacklevel=5)
        for transform in self._amp_transforms:
            transform(captured.gm)
        return Compiled(captured, result.decisions, result.casts, self._runner(captured.gm),
                        opaque)

    def _prepare_opaque(self, call: OpaqueCall) -> None:
        """A submodule cut out of the graph for its hooks runs its own compiled module."""
        if isinstance(call, ModuleCall):
            path = f"{self._amp_path}.{call.path}" if self._amp_path else call.path
            call.runner = self._compile_child(call.module, path)

    def _runner(self, gm: fx.GraphModule) -> Any:
        """What forward calls: the graph's code, or with a backend runtime/compiled.py's."""
        cfg = self.amp_config
        return direct_runner(gm) if cfg.backend is None else compiled_runner(
            gm, cfg.backend, cfg.compile_options, self._runtime_for(self._amp_model))

    def _runtime_for(self, model: nn.Module) -> Runtime:
        """The runtime the config names for the model's device now (made again on a move)."""
        name = self.amp_resolved.runtime_on(model_device(model))
        runtime = self._amp_runtime
        if runtime is None or runtime.name != name:
            runtime = self._amp_runtime = make_runtime(name)
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
        self._amp_eager_reason = reason
        plan = EagerPlan(model, self._amp_path, self._compile_child)
        object.__setattr__(self, "_amp_eager", plan)  # not a child: see the class docstring

    def _compile_child(self, child: nn.Module, path: str) -> AmpModule:
        """A child of the eager plan, compiled on its own with this module's policy."""
        sub = AmpModule(child, self.amp_resolved, path)
        sub._amp_policy = self._amp_policy.under(path, fallback_part=True)
        return sub

    # -- reporting ------------------------------------------------------------------------

    def amp_parts(self) -> tuple[list[tuple[str, Compiled]], list[EagerPart]]:
        """What the last call ran: (compiled graphs with their module prefix, eager parts),
        per submodule when the model fell back; ``explain`` and ``ampgraph inspect`` read it.

        Example:
            >>> graphs, eager = net.amp_parts()
            >>> [prefix for prefix, _ in graphs], [e.path for e in eager]
            ([''], [])
        """
        graphs: list[tuple[str, Compiled]] = []
        eager: list[EagerPart] = []
        if self._amp_eager is None:
            if self._amp_last is not None:
                graphs.append((self._amp_path, self._amp_last))
        else:
            eager.append(EagerPart(self._amp_path or "<root>", type(self._amp_model).__name__,
                                   self._amp_eager_reason or ""))
        for sub in self._parts(last_only=True):
            g, e = sub.amp_parts()
            graphs += g
            eager += e
        return graphs, eager


def _outside_dynamo() -> Callable[..., Any]:
    """``AmpModule._run`` as dynamo's graph break: ``torch.compile`` of a compiled module
    (or of a model holding one) runs it as it is, its graphs ampgraph's, not traced into
    an inductor graph (made on first use: dynamo is imported only once it traces)."""
    if not _DISABLED:
        import torch._dynamo

        def run(net: AmpModule, *args: Any, **kwargs: Any) -> Any:
            if _autocast_on():
                with _autocast_off():
                    return run(net, *args, **kwargs)
            return net._run_hooked(*args, **kwargs)

        _DISABLED.append(torch._dynamo.disable(run, recursive=True))
    return _DISABLED[0]


_DISABLED: list[Callable[..., Any]] = []


def _shapes(leaves: list) -> tuple:
    return tuple(t.shape for t in leaves if isinstance(t, torch.Tensor))


def _raise_eager_error(model: nn.Module, args: tuple, kwargs: dict, exc: Exception) -> None:
    """The graph raised ``exc``: raise what the eager model raises for the same inputs (a
    wrong dtype reads as the user's model would say it, not with the graph's bf16); return
    when eager takes them (``exc`` is then ampgraph's to raise)."""
    try:
        with torch.no_grad():
            forward_of(model)(*args, **kwargs)
    except Exception as eager:
        raise eager from None
    exc.add_note("ampgraph: the eager model takes these inputs; please report this failure")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]

