"""passes/fx/verify.py: the contract check names the node that breaks it."""

from __future__ import annotations

import pytest
import torch

from passes import PassError
from passes.fx import run_amp_passes, verify
from passes.fx.dataflow import build_dataflow
from passes.fx.insert_casts import annotate, insert_casts
from passes.fx.policy import make_policy
from passes.fx.prepare import prepare
from passes.paint import paint
from tests.passes.fx.helpers import TwoConsumers, blocks, export


def test_verify_names_the_node_that_breaks_the_contract():
    model = TwoConsumers()
    gm = export(model, (torch.randn(2, 4),))
    run_amp_passes(gm, make_policy("O2"), torch.bfloat16)
    norm = next(n for n in gm.graph.nodes if str(n.target).startswith("aten.layer_norm"))
    cast = norm.args[0]
    norm.replace_input_with(cast, cast.args[0])  # feed bf16 to the fp32 layer_norm
    with pytest.raises(PassError, match="layer_norm") as info:
        verify(gm, torch.bfloat16)
    assert info.value.pass_name == "verify"


def test_verify_rejects_a_node_used_before_it_is_defined_or_from_another_graph():
    """verify's own ordering check, in place of graph.lint()."""
    from passes._infra import PassError
    from passes.fx.verify import verify

    def rewritten():
        gm = blocks(2)
        prepare(gm)
        annotate(gm, paint(build_dataflow(gm), make_policy("O2")))
        insert_casts(gm, torch.bfloat16)
        verify(gm, torch.bfloat16)
        return gm

    gm = rewritten()
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    user = next(n for n in nodes if any(a.op == "call_function" for a in n.all_input_nodes))
    nodes[0].prepend(user)
    with pytest.raises(PassError, match="not defined before"):
        verify(gm, torch.bfloat16)
    gm, other = rewritten(), rewritten()
    node = next(n for n in gm.graph.nodes if n.op == "call_function" and n.args)
    stranger = next(n for n in other.graph.nodes if n.op == "call_function")
    node.args = (stranger, *node.args[1:])
    with pytest.raises(PassError, match="not defined before"):
        verify(gm, torch.bfloat16)
