"""AmpModule: the module ``ampgraph.compile`` returns.

It shares its parameter, buffer and submodule dicts with the user's model, so
``parameters()``, ``state_dict()``, ``.to()`` and optimizers see the user's fp32 master
weights under the user's names. ``forward`` runs a captured, cast-rewritten graph chosen
by (train/eval mode, input structure), capturing again when either changes. A model that
cannot be exported whole runs its own code eagerly in fp32 with each child compiled on
its own (recursively), and ``explain`` says which parts stayed eager and why.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import fx, nn

from ampgraph.capture import (
    direct_runner,
    export_module,
    flatten_inputs,
    preserved_global_state,
    share_state,
)
from ampgraph.capture.cache import CaptureFailure, Compiled, GraphCache, capture_graph, first_line
from ampgraph.capture.calls import autocast_off, autocast_on, outside_dynamo, raise_eager_error
from ampgraph.capture.fallback import EagerPart, EagerPlan, compiled_children
from ampgraph.capture.generate import route_method
from ampgraph.capture.hooks import ModuleCall, call_with_hooks, forward_of, has_untraced_hooks
from ampgraph.capture.loss_only import graph_mode, head_loss_for
from ampgraph.capture.numbers import as_tensors
from ampgraph.capture.opaque import release
from ampgraph.compiled_class import compiled_class
from ampgraph.config import AmpConfig, ResolvedConfig, dtype_name, model_device
from ampgraph.runtime import Runtime, compiled_runner, make_runtime
from ampgraph.signature import SignedForward, signed_forward
from passes.fx import run_amp_passes
from passes.fx.calibration import observe_magnitudes, overflowing
from passes.policy import NA, LevelPolicy

__all__ = ["AmpModule", "Compiled"]


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
    _amp_cache: GraphCache  # the graphs and how calls pick one (capture/cache.py)
    _amp_graphs: OrderedDict[tuple, list[Compiled]]  # the cache's (mode, signature) -> graphs
    _amp_lock: threading.RLock  # guards the graphs, the refused shapes and going eager
    _amp_eager: nn.Module | None  # the eager plan once export failed (not registered)
    _amp_eager_reason: str | None  # why export failed, for ``explain``
    _amp_last: Compiled | None  # the graph of the last call
    _amp_runtime: Runtime | None  # made for the model's device on the first capture
    _amp_transforms: list[Callable[[fx.GraphModule], Any]]  # see add_graph_transform
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
        self._amp_cache = GraphCache(path or "the model")
        self._amp_graphs = self._amp_cache.graphs
        self._amp_lock = threading.RLock()
        object.__setattr__(self, "_amp_eager", None)
        self._amp_eager_reason = None
        object.__setattr__(self, "_amp_last", None)
        self._amp_runtime = None
        self._amp_transforms = []
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
        copies = [] if self._amp_runtime is None else self._amp_runtime.working_copies()
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
        graphs = [self._amp_last] if last_only else self._amp_cache.all()
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
            self._amp_cache.clear()
            for child in children:
                child.drop_graphs()

    def calibrate(self, *args: Any, **kwargs: Any) -> dict[str, str]:
        """Run the captured graph in fp32 on sample inputs; from the next call on, keep fp32
        the ops whose values exceeded fp16's range there (docs/levels.md): key -> reason.

        Example:
            >>> net.calibrate(latents)  # doctest: +SKIP
        """
        with self._amp_lock, preserved_global_state():
            captured = export_module(self._amp_model, args, kwargs)
            try:  # its opaque calls unbound: they run below autograd, as calibration may
                found = overflowing(observe_magnitudes(captured.gm, args, kwargs), self.amp_dtype)
            finally:
                release(captured.opaque_keys)
            calibrated = {**dict(self._amp_policy.calibrated), **found}
            self._amp_policy = replace(self._amp_policy, calibrated=tuple(calibrated.items()))
            self.drop_graphs()
        return found

    # -- execution ------------------------------------------------------------------------

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # under torch.compile(net): the graphs stay ours
            return outside_dynamo(AmpModule._run_hooked)(self, *args, **kwargs)
        if autocast_on():  # the graph's casts are the precision: autocast must not re-cast
            with autocast_off():
                return self._run_hooked(*args, **kwargs)
        return self._run_hooked(*args, **kwargs)

    def _run_hooked(self, *args: Any, **kwargs: Any) -> Any:
        if has_untraced_hooks(self._amp_model):  # the user's model's own hooks, around it
            return call_with_hooks(self._amp_model, self._run_graph, args, kwargs)
        return self._run_graph(*args, **kwargs)

    def _run_graph(self, *args: Any, **kwargs: Any) -> Any:
        compiled = self._select(args, kwargs)
        if isinstance(compiled, CaptureFailure):  # run as it would fall back, then say so
            compiled.commit(self._go_eager)
            try:
                out = self._run_eagerly(args, kwargs)
            except Exception:  # eager rejects the inputs too: the user's error, no fallback
                compiled.undo()
                raise
            compiled.announce(self._where(), self._announce_eager)
            return out
        if compiled is None:  # eager for good, or for these inputs (compiled_for)
            return self._run_eagerly(args, kwargs)
        given = (args, kwargs) if not compiled.captured.numbers else as_tensors(
            args, kwargs, compiled.captured.numbers)
        try:
            flat = compiled.runner(tuple(given[0]), dict(given[1]))
        except Exception as exc:  # the user's error, in eager's words, if eager rejects them too
            if not compiled.ran:  # a graph captured for inputs nothing can run is dropped
                with self._amp_lock:
                    self._amp_cache.forget(compiled)
            raise_eager_error(self._amp_model, args, kwargs, exc)
            raise
        compiled.ran = True
        return compiled.captured.rebuild(flat, args, kwargs)

    def _run_eagerly(self, args: tuple, kwargs: dict) -> Any:
        run = self._amp_eager if self._amp_eager is not None else forward_of(self._amp_model)
        return run(*args, **kwargs)

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
            found.commit(self._go_eager)
            found.announce(self._where(), self._announce_eager)
            return None
        return found

    def _select(self, args: tuple, kwargs: dict) -> Compiled | CaptureFailure | None:
        """:meth:`compiled_for` from the graph cache (``capture/cache.py``), a failed capture
        returned uncommitted."""
        with self._amp_lock:
            if self._amp_eager is not None:
                return None
            try:
                leaves, spec = flatten_inputs(args, kwargs)
            except Exception as exc:  # e.g. a cache whose layer types its flatten refuses
                self._go_eager(f"inputs cannot be flattened: {first_line(exc)}")
                self._announce_eager(self._amp_eager_reason)
                return None
            # the state no longer the last graph's: the kept weight copies go (weights may
            # have changed through .data too, which no version shows: PEFT's merge_adapter)
            found = self._amp_cache.select(
                graph_mode(self.training), leaves, spec,
                lambda numbers: self._capture(args, kwargs, numbers),
                lambda: self._amp_runtime is not None and self._amp_runtime.clear())
            object.__setattr__(self, "_amp_last", self._amp_cache.last)
            return found

    def _capture(self, args: tuple, kwargs: dict, numbers: tuple = ()
                 ) -> Compiled | CaptureFailure:
        model = self._amp_model
        cfg = self.amp_config

        def rewrite(gm: fx.GraphModule) -> Any:  # the AMP passes, the opaque calls bound
            result = run_amp_passes(gm, self._amp_policy, self.amp_dtype,
                                    keep_io_types=cfg.keep_io_types,
                                    runtime=self._runtime_for(model).ops(cfg.backend), fp8=cfg.fp8,
                                    head_loss=head_loss_for(cfg.head_loss, self.training))
            if cfg.amp_level != "O0" and not any(
                    d.precision != NA for d in result.decisions.values() if d.cls):
                warnings.warn(f"ampgraph: {self._where()} has no floating-point ops; "
                              "compiling it changes nothing", UserWarning, stacklevel=7)
            return result

        return capture_graph(model, args, kwargs, numbers, self._amp_path or "model", rewrite,
                             lambda call: call.prepare(self._compile_child, self._amp_path),
                             self._amp_transforms, self._runner)

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

    def _go_eager(self, reason: str) -> Callable[[], None]:
        """Fall back: the model's own code runs eagerly, each child compiled; returns what
        takes it back (the eager code rejected the inputs too)."""
        with self._amp_lock:
            if self._amp_eager is not None:
                return lambda: None
            self._amp_eager_reason = reason
            plan = EagerPlan(self._amp_model, self._amp_path, self._compile_child)
            object.__setattr__(self, "_amp_eager", plan)  # not a child: see the class doc

        def undo() -> None:
            with self._amp_lock:
                if self._amp_eager is plan:
                    object.__setattr__(self, "_amp_eager", None)
                    self._amp_eager_reason = None
        return undo

    def _announce_eager(self, reason: str | None) -> None:
        warnings.warn(
            f"ampgraph: {self._where()} could not be captured whole ({reason}); its own code "
            "runs eagerly in fp32 and each submodule is compiled separately. "
            "ampgraph.explain(model) lists what stayed eager.", UserWarning, stacklevel=5)

    def _where(self) -> str:
        return self._amp_path or type(self._amp_model).__name__

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
        graphs = [(self._amp_path, self._amp_last)] if self._amp_eager is None and \
            self._amp_last is not None else []
        eager = [] if self._amp_eager is None else [EagerPart(
            self._amp_path or "<root>", type(self._amp_model).__name__,
            self._amp_eager_reason or "")]
        for sub in self._parts(last_only=True):
            g, e = sub.amp_parts()
            graphs += g
            eager += e
        return graphs, eager
