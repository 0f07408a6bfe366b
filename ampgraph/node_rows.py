"""The report's rows: one per original graph node, with its precision and the reason.

``explain`` (``report.py``) and ``ampgraph inspect`` (``cli/analysis.py``) read a compiled
graph through :func:`node_rows`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import fx

from ampgraph.config import dtype_name
from ampgraph.module import Compiled
from passes.fx.checkpoints import UNHONOURED_KEY
from passes.fx.costs import node_flops
from passes.fx.dtypes import dtype_of
from passes.fx.nodes import module_info, op_key
from passes.policy import FP32, LOW, NA


def node_rows(prefix: str, compiled: Compiled, low: torch.dtype) -> list[dict[str, Any]]:
    """One row per original graph node: name, op, module, precision, reason, and the
    node's matmul/conv/attention FLOPs (``passes.fx.costs.node_flops``).

    Example:
        >>> graphs, _ = net.amp_parts()  # doctest: +SKIP
        >>> node_rows(*graphs[0], torch.bfloat16)[0]["precision"]  # doctest: +SKIP
        'bf16'
    """
    rows = []
    for node in _with_absorbed(compiled.gm.graph.nodes):
        if node.op in ("output", "call_module") or node.meta.get("amp_cast") \
                or node.meta.get("amp_region_output"):
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
        rows.append({"name": public(node.name),
                     "op": op if node.op == "call_function" else node.op,
                     "module": module, "precision": precision, "reason": public(reason),
                     "flops": node_flops(node)})
    for entry in compiled.gm.meta.get(UNHONOURED_KEY, ()):  # said loudly, in a row too
        rows.append({"name": f"checkpoint_region_{entry['region']}", "op": "checkpoint",
                     "module": ".".join(p for p in (prefix, entry["module"]) if p),
                     "precision": NA, "reason": "activation checkpoint NOT honoured "
                     f"({entry['nodes']} nodes kept inline): {entry['reason']}"})
    return rows


# torch.export's names for tensors a forward made (torch.tensor(...)): a user wrote no
# such name, so rows call them what they are
_LIFTED = re.compile(r"lifted_tensor_(\d+)")


def public(text: str) -> str:
    """``text`` with torch.export's internal constant names replaced.

    Example:
        >>> public("attn.lifted_tensor_0 cast once")
        'attn.forward_constant_0 cast once'
    """
    return _LIFTED.sub(r"forward_constant_\1", text)


def _with_absorbed(nodes: Iterable[fx.Node]) -> Iterator[fx.Node]:
    """The graph's nodes, each followed by the nodes a runtime op absorbed (a linear's
    activation, ``meta["amp_absorbed"]``): they still run, inside it."""
    for node in nodes:
        yield node
        yield from node.meta.get("amp_absorbed", ())
