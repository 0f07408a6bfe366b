"""ampgraph/cli/module_tree.py: the report's module tree, its sums and its folded blocks."""

from __future__ import annotations

from ampgraph.cli.analysis import GraphView, ViewNode
from ampgraph.cli.module_tree import (
    Fold,
    build_tree,
    cast_modules,
    flop_class,
    grouped,
    tree_data,
)
from ampgraph.cli.render import Inspection


def blocks(softmax: list[str], extra_in: int | None = None) -> Inspection:
    """A hand-made encoder: ``enc.layer.i`` = linear (+ weight param) -> softmax; the
    softmax of block i runs in ``softmax[i]``; block ``extra_in`` has one more op."""
    rows = [{"name": "x", "op": "placeholder", "module": "", "precision": "fp32",
             "reason": "graph input", "flops": 0}]
    view = GraphView([ViewNode("x", "x", "placeholder", "fp32", "input")], [])
    for i, p in enumerate(softmax):
        m = f"enc.layer.{i}"
        rows += [
            {"name": f"w{i}", "op": "get_attr", "module": f"{m}.fc", "precision": "fp32",
             "reason": "parameter", "flops": 0},
            {"name": f"mm{i}", "op": "aten.linear", "module": f"{m}.fc", "precision": "bf16",
             "reason": "allow", "flops": 100},
            {"name": f"sm{i}", "op": "aten.softmax", "module": f"{m}.attn", "precision": p,
             "reason": "deny: exp overflows" if p == "fp32" else "infer", "flops": 0},
        ]
        if i == extra_in:
            rows.append({"name": f"gelu{i}", "op": "aten.gelu", "module": f"{m}.attn",
                         "precision": "bf16", "reason": "infer", "flops": 0})
        view.nodes += [ViewNode(f"c{i}", "cast to bf16", "cast", "cast", "cast", "",
                                f"{m}.fc.weight"),
                       ViewNode(f"mm{i}", f"mm{i}", "aten.linear", "bf16", "op", f"{m}.fc")]
        view.edges.append((f"c{i}", f"mm{i}"))
    rows.append({"name": "head", "op": "aten.linear", "module": "head", "precision": "fp8",
                 "reason": "FP8 product", "flops": 300})
    summary = {"nodes": len(rows), "by_precision": {}}
    return Inspection("t", "torch", "O2", "bf16", rows, len(softmax), summary, view)


def test_numbers_are_summed_over_each_subtree():
    root = build_tree(blocks(["bf16", "bf16", "fp32"]))
    assert [c.path for c in root.children] == ["enc", "head"]
    assert root.flops == {"low": 300, "fp8": 300, "fp32": 0}
    assert root.ops == {"bf16": 5, "fp32": 1, "fp8": 1}  # the input is not an op
    assert root.params == 3 and root.casts == 3
    assert root.fp32_reasons == {"deny: exp overflows": 1}
    layer = root.children[0].children[0]
    assert layer.path == "enc.layer" and [c.name for c in layer.children] == [
        "layer 0", "layer 1", "layer 2"]
    assert layer.children[2].fp32_reasons == {"deny: exp overflows": 1}


def test_a_cast_belongs_to_the_module_of_the_op_it_feeds():
    insp = blocks(["bf16", "bf16"])
    assert cast_modules(insp) == ["enc.layer.0.fc", "enc.layer.1.fc"]
    fc = build_tree(insp).children[0].children[0].children[0].children[0]
    assert fc.path == "enc.layer.0.fc" and fc.casts == 1


def test_identical_numbered_blocks_fold_and_a_different_one_says_how():
    layer = build_tree(blocks(["bf16", "bf16", "bf16", "fp32"])).children[0].children[0]
    groups = grouped(layer.children)
    assert isinstance(groups[0], Fold) and groups[0].name == "layer 0-2"
    assert [m.path for m in groups[0].members] == [f"enc.layer.{i}" for i in range(3)]
    assert groups[1].path == "enc.layer.3"
    assert groups[1].note == ("plan differs from layer 0's: attn aten.softmax: fp32 here, "
                              "bf16 there")
    assert all(not m.note for m in groups[0].members)


def test_a_block_with_another_structure_names_what_only_it_has():
    layer = build_tree(blocks(["bf16"] * 4, extra_in=1)).children[0].children[0]
    assert [g.name for g in grouped(layer.children)] == ["layer 0", "layer 1", "layer 2-3"]
    assert layer.children[1].note == ("plan differs from layer 0's: "
                                      "attn aten.gelu bf16 only here")


def test_a_fold_needs_two_blocks_and_only_numbered_ones_fold():
    layer = build_tree(blocks(["bf16", "fp32", "bf16"])).children[0].children[0]
    assert [g.name for g in grouped(layer.children)] == ["layer 0", "layer 1", "layer 2"]
    root = build_tree(blocks(["bf16", "bf16"]))
    assert [g.name for g in grouped(root.children)] == ["enc", "head"]


def test_the_tree_as_json():
    data = tree_data(build_tree(blocks(["bf16", "bf16", "fp32"])))
    assert data["p"] == "" and data["n"] == "(model)" and data["f"] == [300, 300, 0]
    assert data["o"] == {"bf16": 5, "fp32": 1, "fp8": 1} and data["w"] == 3 and data["c"] == 3
    assert data["r"] == [["deny: exp overflows", 1]]
    layer = data["k"][0]["k"][0]
    fold, last = layer["k"]
    assert fold["fold"] == "layer 0-1" and [m["p"] for m in fold["m"]] == [
        "enc.layer.0", "enc.layer.1"]
    assert last["d"].startswith("plan differs from layer 0's")


def test_flop_classes():
    assert [flop_class(p) for p in ("bf16", "fp16", "fp8", "fp32", "n/a")] == [
        "low", "low", "fp8", "fp32", "fp32"]
