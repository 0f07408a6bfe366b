"""Capture a module with torch.export and keep one graph per (mode, input structure).

The ``no_grad`` regions export records are inlined right after export
(``passes.fx.no_grad_regions``).

- ``export``: the exported root taking ``(args, kwargs)``, ``export_module``, ``Captured``;
- ``dynamic_dims``: which input dimensions export is asked to keep dynamic;
- ``structure``: flattening outputs (and inputs) of any structure, rebuilding them;
- ``hf_caches``: every HuggingFace cache and cache-layer class as a pytree node;
- ``object_nodes``: objects flattened by their attributes and rebuilt as the same class;
- ``state``: ``preserved_global_state``, around every export attempt;
- ``codegen``: the Python that runs a graph once the passes are done (``direct_runner``);
- ``fallback``: the eager plan of a model export refuses whole (each child compiled alone);
- ``generate``: HuggingFace ``generate`` (a method calling ``self(...)``) run through the
  compiled module.
"""

from __future__ import annotations

from ampgraph.capture.codegen import direct_runner
from ampgraph.capture.dynamic_dims import dynamic_spec
from ampgraph.capture.export import (
    Captured,
    ExportRoot,
    UnsupportedInput,
    check_exportable,
    export_module,
    flatten_inputs,
    repoint_state,
    share_state,
    signature,
    signature_of,
)
from ampgraph.capture.hf_caches import register_hf_caches
from ampgraph.capture.logs import quiet_export_logs
from ampgraph.capture.state import preserved_global_state
from ampgraph.capture.structure import flatten_output, unflatten_output

__all__ = [
    "Captured",
    "ExportRoot",
    "UnsupportedInput",
    "check_exportable",
    "direct_runner",
    "dynamic_spec",
    "export_module",
    "flatten_inputs",
    "flatten_output",
    "preserved_global_state",
    "quiet_export_logs",
    "register_hf_caches",
    "repoint_state",
    "share_state",
    "signature",
    "signature_of",
    "unflatten_output",
]
