"""The dialect-free painter on small hand-built graphs, one rule at a time."""

from __future__ import annotations

import networkx as nx
import pytest

from passes.fx.policy import make_policy
from passes.paint import paint
from passes.policy import FP32, LOW, NA


def chain(*ops, sources=("x",)):
    g = nx.DiGraph()
    for s in sources:
        g.add_node(s, kind="source")
    prev = sources[0]
    for i, op in enumerate(ops):
        name = f"{i}:{op}"
        g.add_node(name, kind="compute", op=f"aten.{op}")
        g.add_edge(prev, name)
        prev = name
    return g


def precisions(g, level, **kw):
    a = paint(g, make_policy(level, **kw))
    return {k.split(":")[-1] if ":" in k else k: d.precision for k, d in a.items()}, a


def test_o0_everything_fp32_o3_everything_low():
    g = chain("mm", "softmax", "layer_norm", "gelu")
    p0, _ = precisions(g, "O0")
    p3, _ = precisions(g, "O3")
    assert set(v for k, v in p0.items() if k != "x") == {FP32}
    assert set(v for k, v in p3.items() if k != "x") == {LOW}
    assert p0["x"] == NA


def test_o1_fill_between_allow_ops_no_cast_pair():
    p, a = precisions(chain("mm", "gelu", "add", "mm"), "O1")
    assert p["gelu"] == p["add"] == LOW
    assert "fill" in a["1:gelu"].reason


def test_o1_deny_propagates_through_infer_ops():
    p, a = precisions(chain("mm", "softmax", "gelu", "add"), "O1")
    assert p["mm"] == LOW and p["softmax"] == FP32
    assert p["gelu"] == FP32 and p["add"] == FP32
    assert "deny propagation" in a["2:gelu"].reason


def test_o1_deny_does_not_stop_fill_through_clear_to_allow():
    p, _ = precisions(chain("softmax", "view", "mm"), "O1")
    assert p["softmax"] == FP32 and p["view"] == LOW and p["mm"] == LOW


def test_o1_infer_after_low_becomes_low_and_clear_spreads():
    p, _ = precisions(chain("mm", "gelu", "view"), "O1")
    assert p["gelu"] == LOW and p["view"] == LOW


def test_o1_infer_fed_only_by_inputs_stays_fp32():
    p, _ = precisions(chain("gelu", "add"), "O1")
    assert p["gelu"] == FP32 and p["add"] == FP32


def test_o2_deny_ops_fp32_everything_else_low_clear_follows_fp32_producer():
    p, a = precisions(chain("mm", "softmax", "view", "mm", "gelu", "layer_norm"), "O2")
    assert [p[k] for k in ("mm", "softmax", "view", "gelu", "layer_norm")] == \
        [LOW, FP32, FP32, LOW, FP32]
    assert "deny list" in a["1:softmax"].reason


def test_o2_clear_on_weights_follows_consumers():
    g = nx.DiGraph()
    g.add_node("w", kind="source")
    g.add_node("t", kind="compute", op="aten.t")
    g.add_node("mm", kind="compute", op="aten.mm")
    g.add_edges_from([("w", "t"), ("t", "mm")])
    p, _ = precisions(g, "O2")
    assert p["t"] == LOW


def test_nonfloat_and_module_overrides():
    g = chain("mm", "gelu")
    g.add_node("argmax", kind="nonfloat", op="aten.argmax")
    g.add_edge("1:gelu", "argmax")
    nx.set_node_attributes(g, {"0:mm": "head"}, "module")
    p, a = precisions(g, "O3", module_rules=[("head", FP32, "module_overrides")])
    assert p["argmax"] == NA and p["mm"] == FP32 and "module override" in a["0:mm"].reason


def test_o2_infer_ops_between_fp32_ops_stay_fp32():
    """RMSNorm: mean -> add eps -> rsqrt; a view among them goes with them."""
    p, a = precisions(chain("mm", "mean", "add", "rsqrt", "mul", "mm"), "O2")
    assert [p[k] for k in ("mean", "add", "rsqrt", "mul")] == [FP32, FP32, FP32, LOW]
    assert "between fp32 ops" in a["2:add"].reason
    p, _ = precisions(chain("mm", "mean", "view", "add", "mul", "rsqrt", "mm"), "O2")
    assert [p[k] for k in ("view", "add", "mul")] == [FP32, FP32, FP32]
    # O1 and O3 keep their own rules
    assert precisions(chain("mm", "mean", "add", "rsqrt", "mm"), "O3")[0]["add"] == LOW


def test_o2_infer_ops_with_a_low_neighbour_or_a_returned_value_stay_low():
    g = chain("mm", "mean", "add", "rsqrt")
    g.add_node("mm2", kind="compute", op="aten.mm")
    g.add_edge("2:add", "mm2")  # one low consumer: the cast is needed anyway
    assert precisions(g, "O2")[0]["add"] == LOW
    g = chain("mm", "mean", "add", "rsqrt")
    g.nodes["2:add"]["returned"] = True  # its dtype is the graph's output dtype
    assert precisions(g, "O2")[0]["add"] == LOW
    g = chain("mm", "mean", "add", "gelu", "rsqrt", "mm")
    g.add_node("mm2", kind="compute", op="aten.mm")
    g.add_edge("mm2", "3:gelu")  # a low producer in the middle: neither side is fp32-only
    p, _ = precisions(g, "O2")
    assert p["add"] == p["gelu"] == LOW
    # fed by sources alone (no fp32 producer): low, as before
    assert precisions(chain("add", "rsqrt"), "O2")[0]["add"] == LOW
    # a long chain decided by its far end, either way
    long = ("softmax", *["mul", "view"] * 1000)
    for end, expected in (("mm", LOW), ("rsqrt", FP32)):
        _, a = precisions(chain(*long, end), "O2")
        middle = {d.precision for v, d in a.items() if v.endswith((":mul", ":view"))}
        assert middle == {expected}
    # a norm the user put low (keep_batchnorm_fp32=False) stays low between fp32 ops
    p, _ = precisions(chain("mm", "softmax", "layer_norm", "rsqrt"), "O2", keep_norm_fp32=False)
    assert p["layer_norm"] == LOW


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_every_vertex_gets_a_decision_with_a_reason(level):
    g = chain("conv2d", "batch_norm", "relu", "mean", "linear", "log_softmax", "nll_loss")
    a = paint(g, make_policy(level))
    assert set(a) == set(g.nodes) and all(d.reason for d in a.values())


def test_o2_clear_chain_fed_only_by_sources_follows_consumers():
    """weight -> t -> expand -> mm: a CLEAR chain with no compute producer (was a KeyError)."""
    g = nx.DiGraph()
    g.add_node("w", kind="source")
    for name, op in (("t", "aten.t"), ("expand", "aten.expand"), ("mm", "aten.mm"),
                     ("view", "aten.view"), ("ln", "aten.layer_norm")):
        g.add_node(name, kind="compute", op=op)
    g.add_edges_from([("w", "t"), ("t", "expand"), ("expand", "mm"), ("w", "view"),
                      ("view", "ln")])
    p, _ = precisions(g, "O2")
    assert p["t"] == p["expand"] == LOW
    assert p["view"] == FP32


def test_o1_reasons_do_not_depend_on_the_hash_seed():
    """Which low neighbour a clear op's reason names used to follow a set's order, which
    changes with PYTHONHASHSEED; the precisions never did."""
    import os
    import subprocess
    import sys

    # per motif: x -> r1 -> mm_c and r1 -> r2 -> r3 -> mm_b; r1 and r3 turn low from their
    # matmuls, and r2 names whichever of them was low first
    code = (
        "import networkx as nx\n"
        "from passes.paint import paint\n"
        "from passes.fx.policy import make_policy\n"
        "g = nx.DiGraph()\n"
        "for m in range(10):\n"
        "    x, r1, r2, r3, mc, mb = (f'{m}{n}' for n in ('x', 'r1', 'r2', 'r3', 'mc', 'mb'))\n"
        "    g.add_node(x, kind='source')\n"
        "    for v, op in ((r1, 'relu'), (mc, 'mm'), (r2, 'relu'), (r3, 'relu'), (mb, 'mm')):\n"
        "        g.add_node(v, kind='compute', op=f'aten.{op}')\n"
        "    g.add_edges_from([(x, r1), (r1, mc), (r1, r2), (r2, r3), (r3, mb)])\n"
        "a = paint(g, make_policy('O1'))\n"
        "print(sorted((k, d.precision, d.reason) for k, d in a.items()))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    outs = set()
    for seed in ("0", "1", "2", "3"):
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": path}
        run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stderr
        outs.add(run.stdout)
    assert len(outs) == 1, outs


def clear_chain(order):
    """w -> t -> expand -> mm, plus softmax -> view -> gelu, vertices added in ``order``."""
    ops = {"w": None, "x": None, "t": "aten.t", "expand": "aten.expand", "mm": "aten.mm",
           "softmax": "aten.softmax", "view": "aten.view", "gelu": "aten.gelu"}
    g = nx.DiGraph()
    for v in order:
        if ops[v] is None:
            g.add_node(v, kind="source")
        else:
            g.add_node(v, kind="compute", op=ops[v])
    g.add_edges_from([("w", "t"), ("t", "expand"), ("expand", "mm"), ("x", "softmax"),
                      ("softmax", "view"), ("view", "gelu")])
    return g



def test_painter_result_does_not_depend_on_vertex_order():
    forward = ["w", "x", "t", "expand", "mm", "softmax", "view", "gelu"]
    a = paint(clear_chain(forward), make_policy("O2"))
    b = paint(clear_chain(forward[::-1]), make_policy("O2"))
    assert a == b
    assert a["t"].precision == a["expand"].precision == LOW
    assert a["view"].precision == FP32



def test_painter_rejects_a_cycle_among_clear_ops():
    g = clear_chain(["w", "x", "t", "expand", "mm", "softmax", "view", "gelu"])
    g.add_edge("expand", "t")
    with pytest.raises(nx.NetworkXUnfeasible):
        paint(g, make_policy("O2"))



@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_selection_and_the_ops_making_its_inputs_are_fp32_back_to_the_matmul(level):
    """A sigmoid MoE router: mm -> sigmoid -> add bias -> topk. In bf16 the sigmoid's scores
    tie and top-k picks other experts (rule 7); the mm stays low, as autocast runs it."""
    g = chain("mm", "sigmoid", "add", "topk", "gather", "mm")
    p, a = precisions(g, level)
    assert [p[k] for k in ("sigmoid", "add", "topk")] == [FP32] * 3
    assert a["0:mm"].precision == a["5:mm"].precision == LOW
    assert "feeds the selection 3:topk" in a["1:sigmoid"].reason
    if level == "O2":  # after fp32 ops: the cast moves to the low consumer (rule 5)
        assert p["gather"] == FP32
    # an argmax (integer output): the float ops feeding it, not the argmax itself
    g = chain("mm", "sigmoid")
    g.add_node("argmax", kind="nonfloat", op="aten.argmax")
    g.add_edge("1:sigmoid", "argmax")
    p, _ = precisions(g, level)
    assert (p["mm"], p["sigmoid"], p["argmax"]) == (LOW, FP32, NA)


def test_a_selection_does_not_reach_past_fp32_ops_overrides_or_o3():
    g = chain("mm", "softmax", "topk")  # softmax is fp32 already: nothing more
    p, a = precisions(g, "O2")
    assert (p["mm"], p["softmax"], p["topk"]) == (LOW, FP32, FP32)
    g = chain("mm", "sigmoid", "topk")
    nx.set_node_attributes(g, {"1:sigmoid": "router"}, "module")
    p, a = precisions(g, "O2", module_rules=[("router", LOW, "module_overrides")])
    assert p["sigmoid"] == LOW and "module override" in a["1:sigmoid"].reason
    assert precisions(chain("mm", "sigmoid", "topk"), "O3")[0]["sigmoid"] == LOW


def test_a_fallback_part_without_a_matrix_op_is_fp32_at_o1_and_o2_only():
    g = chain("mul", "floor", "add", "softmax")  # box coordinates and a level map, no product
    for level in ("O1", "O2"):
        part = make_policy(level).under("roi_pool", fallback_part=True)
        a = paint(g, part)
        assert {a[f"{i}:{op}"].precision for i, op in enumerate(("mul", "floor", "add"))} \
            == {FP32}, level
        assert "eager fallback part without a matrix product" in a["0:mul"].reason
        assert a["3:softmax"].reason.startswith("deny list"), "a deny op keeps its reason"
    whole, _ = precisions(g, "O2")
    assert whole["mul"] == LOW, "compiled whole (not a fallback part): O2 as before"
    o3 = paint(g, make_policy("O3").under("roi_pool", fallback_part=True))
    assert o3["0:mul"].precision == LOW, "O3 keeps everything low"


def test_a_fallback_part_with_a_matrix_op_or_a_low_override_paints_as_usual():
    part = make_policy("O2").under("head", fallback_part=True)
    assert part.under("head.fc").fallback_part, "a child of a part is a part"
    a = paint(chain("mm", "mul"), part)
    assert a["0:mm"].precision == LOW and a["1:mul"].precision == LOW
    forced = make_policy("O2", module_rules=[("roi_pool", LOW, "module_overrides")])
    g = chain("mul", "add")
    for v in ("0:mul", "1:add"):
        g.nodes[v]["module"] = "roi_pool"
    a = paint(g, forced.under("", fallback_part=True))
    assert a["0:mul"].precision == LOW and "module override" in a["0:mul"].reason
