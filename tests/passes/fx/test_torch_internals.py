"""passes/fx/_torch_internals.py: each private internal keeps its public meaning, and no
other file of passes/ reaches into torch's private parts."""

from __future__ import annotations

import io
import operator
import pathlib
import re
import tokenize

import torch
from torch import fx
from torch.fx.experimental.proxy_tensor import make_fx

from passes.fx import _torch_internals as ti
from passes.fx.dtypes import CAST

ROOT = pathlib.Path(__file__).resolve().parents[3]
PRIVATE = re.compile(
    r"\btorch\._|\b_pytree\b|\bfx\._(?!torch_internals\b)|\b_illegal_char_regex\b"
    r"|\._(schema|overloadname|input_nodes|update_args_kwargs|has_symbolic_sizes_strides"
    r"|create_node_hooks|target_to_str|find_nodes_lookup_table|args|kwargs|prev|next"
    r"|erased|graph_namespace|codegen|illegal_char_regex)\b")


def code_only(path: pathlib.Path) -> str:
    """The file with its strings and comments blanked (docstrings may name internals)."""
    lines = path.read_text().splitlines(keepends=True)
    for tok in tokenize.generate_tokens(io.StringIO("".join(lines)).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            (r0, c0), (r1, c1) = tok.start, tok.end
            for r in range(r0, r1 + 1):
                line = lines[r - 1]
                a = c0 if r == r0 else 0
                b = c1 if r == r1 else len(line.rstrip("\n"))
                lines[r - 1] = line[:a] + " " * (b - a) + line[b:]
    return "".join(lines)


def test_only_this_module_uses_private_torch_internals():
    offenders = {}
    for path in sorted((ROOT / "passes").rglob("*.py")):
        if path.name == "_torch_internals.py":
            continue
        found = sorted({m.group(0) for m in PRIVATE.finditer(code_only(path))})
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


def graph():
    g = fx.Graph()
    x, y = g.placeholder("x"), g.placeholder("y")
    node = g.call_function(torch.add, (x, [y, x]), {"alpha": y})
    g.output(node)
    return g, x, y, node


def test_input_nodes_is_all_input_nodes():
    _, x, y, node = graph()
    assert list(ti.input_nodes(node)) == node.all_input_nodes == [x, y]


def test_relink_leaves_what_assigning_args_and_kwargs_leaves():
    g1, x1, y1, n1 = graph()
    g2, x2, y2, n2 = graph()
    ti.relink(n1, (y1, [y1, y1]), {"alpha": x1})
    n2.args, n2.kwargs = (y2, [y2, y2]), {"alpha": x2}
    assert str(g1) == str(g2)
    assert [u.name for u in x1.users] == [u.name for u in x2.users]
    assert [u.name for u in y1.users] == [u.name for u in y2.users]
    ti._relink_public(n1, (x1, [x1, y1]), {"alpha": y1})
    assert n1.all_input_nodes == [x1, y1]


def test_cast_node_name_is_the_name_create_node_derives():
    g, x, _, _ = graph()
    derived = g.create_node("call_function", CAST, (x,), {"dtype": torch.float16})
    given = g.create_node("call_function", CAST, (x,), {"dtype": torch.float16},
                          name=ti.cast_node_name(g, CAST))
    assert ti.cast_node_name(g, CAST) == "_to_copy_default"
    assert derived.name == "_to_copy_default" and given.name == "_to_copy_default_1"
    assert ti.create_node_hooks(fx.GraphModule(torch.nn.Module(), g)) in (None, [])


def test_op_schemas_and_overloads():
    add_ = torch.ops.aten.add_.Tensor
    assert isinstance(add_, ti.OpOverload) and isinstance(torch.ops.aten.add, ti.OpOverloadPacket)
    assert ti.TORCH_OPS == (ti.OpOverload, ti.OpOverloadPacket)
    schema = ti.op_schema(add_)
    assert schema.is_mutable and schema.name == "aten::add_"
    assert schema.arguments[0].alias_info.is_write
    assert ti.overload_name(add_) == "Tensor"
    assert ti.overload_name(torch.ops.aten.relu.default) == "default"


def test_fake_tensors_symbolic_sizes_and_pytree():
    gm = make_fx(lambda x: x * 2, tracing_mode="symbolic")(torch.randn(3, 4))
    x = next(n for n in gm.graph.nodes if n.op == "placeholder").meta["val"]
    assert type(x) is ti.FakeTensor and ti.detect_fake_mode([x]) is x.fake_mode
    assert ti.has_symbolic_sizes_strides(x)
    assert [ti.size_hint(d) for d in x.shape] == [3, 4]
    static = make_fx(lambda x: x * 2, tracing_mode="fake")(torch.randn(3, 4))
    y = next(n for n in static.graph.nodes if n.op == "placeholder").meta["val"]
    assert not ti.has_symbolic_sizes_strides(y)
    assert ti.tree_map(lambda v: v + 1, (1, [2, {"a": 3}])) == (2, [3, {"a": 4}])
    assert ti.input_nodes is not operator.attrgetter("all_input_nodes")
