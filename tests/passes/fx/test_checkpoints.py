"""passes/fx/checkpoints.py: a marked region becomes one checkpointed call (same values and
gradients, its activations not saved, the casts only it reads inside it); a region that
cannot be outlined stays inline, with a warning and an entry for explain."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx.traceback as fx_traceback
from torch import fx, nn

import passes.fx.checkpoints as checkpoints
from passes.fx.checkpoints import (
    REGION_KEY,
    UNHONOURED_KEY,
    CheckpointedRegion,
    CheckpointWarning,
    outline_checkpoints,
    region_of,
)

OPTIONS = {"preserve_rng_state": True}


class Blocks(nn.Module):
    """Two MLP blocks, the first traced as region 0 (dropout: its recomputation must draw
    the same mask)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 16))
        self.b = nn.Linear(16, 16)

    def forward(self, x):
        with fx_traceback.annotate({REGION_KEY: (0, OPTIONS)}):
            h = x + self.a(x)
        return self.b(h).relu()


def export(model: nn.Module, x: torch.Tensor) -> fx.GraphModule:
    with fx_traceback.preserve_node_meta():
        return torch.export.export(model.train(), (x,), strict=False).module()


def saved_bytes(gm: fx.GraphModule, *args) -> tuple[int, torch.Tensor]:
    """Bytes of the storages autograd saves outside checkpoints, parameters left out."""
    params = {p.untyped_storage().data_ptr() for p in gm.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = gm(*args)
    return sum(seen.values()), out


def run(gm: fx.GraphModule, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(3)
    out = gm(x)
    out.sum().backward()
    grads = [p.grad.clone() for p in gm.parameters()]
    gm.zero_grad(set_to_none=True)
    return out, grads


def test_region_is_one_checkpointed_call_with_the_same_values_and_gradients():
    torch.manual_seed(0)
    x = torch.randn(64, 16)
    gm = export(Blocks(), x)
    marked = [n.name for n in gm.graph.nodes if region_of(n) is not None]
    assert marked and all(region_of(n) is None for n in gm.graph.nodes
                          if n.op == "call_function" and n.name not in marked)
    want, want_grads = run(gm, x)
    inline_bytes, _ = saved_bytes(gm, x)

    assert outline_checkpoints(gm).modified
    gm.recompile()
    calls = [n for n in gm.graph.nodes if isinstance(n.target, CheckpointedRegion)]
    assert len(calls) == 1
    region = calls[0].target
    assert region.options == OPTIONS
    inside = {n.name for n in region.gm.graph.nodes if n.op == "call_function"}
    assert inside == set(marked)
    assert [n.name for n in calls[0].meta["amp_absorbed"]] == [
        n.name for n in region.gm.graph.nodes if n.op == "call_function"]
    assert not any(n.name in marked for n in gm.graph.nodes)  # moved, not copied

    got, got_grads = run(gm, x)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the dropout mask redrawn alike
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    outlined_bytes, _ = saved_bytes(gm, x)
    assert outlined_bytes < inline_bytes / 2  # the 64x64 activations are not kept


def test_casts_only_the_region_reads_move_into_it_not_traced_ops():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    gm = export(Blocks(), x)
    graph = gm.graph
    first = next(n for n in graph.nodes if n.op == "call_function")
    placeholder = next(n for n in graph.nodes if n.op == "placeholder")
    with graph.inserting_before(first):  # a pass's cast, unmarked, read only by the region
        cast = graph.call_function(torch.ops.aten._to_copy.default, (placeholder,),
                                   {"dtype": torch.float32})
    placeholder.replace_all_uses_with(cast, delete_user_cb=lambda u: u is first)
    cast.meta.update(val=placeholder.meta["val"], amp_cast=True)
    assert region_of(first) is not None and region_of(cast) is None
    outline_checkpoints(gm)
    (call,) = [n for n in graph.nodes if isinstance(n.target, CheckpointedRegion)]
    inside = {n.name for n in call.target.gm.graph.nodes}
    assert cast.name in inside and cast not in graph.nodes
    assert "linear_2" not in inside  # the op after the region reads only its output


def test_region_outputs_are_getitems_and_the_graph_lints():
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    gm = export(Blocks(), x)
    outline_checkpoints(gm)
    gm.graph.lint()
    (call,) = [n for n in gm.graph.nodes if isinstance(n.target, CheckpointedRegion)]
    assert all(u.target is operator.getitem and u.meta["amp_region_output"]
               for u in call.users)


def test_without_gradients_the_region_runs_without_checkpoint(monkeypatch):
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    gm = export(Blocks(), x)
    outline_checkpoints(gm)
    gm.recompile()

    def refuse(*args, **kwargs):
        raise AssertionError("checkpoint called without gradients")

    monkeypatch.setattr(checkpoints, "checkpoint", refuse)
    with torch.no_grad():
        gm(x)
    with torch.inference_mode():
        gm(x)


class Tangled(nn.Module):
    """A region whose output feeds, through an op outside it, the region again."""

    def forward(self, x):
        with fx_traceback.annotate({REGION_KEY: (0, OPTIONS)}):
            h = x.sin()
        g = h.cos()  # outside
        with fx_traceback.annotate({REGION_KEY: (0, OPTIONS)}):
            return h * g.exp()


def test_a_region_that_cannot_be_outlined_is_reported_not_dropped():
    x = torch.randn(4, 4)
    gm = export(Tangled(), x)
    want = gm(x)
    with pytest.warns(CheckpointWarning, match="not recomputed in backward"):
        result = outline_checkpoints(gm)
    assert not result.modified
    (entry,) = gm.meta[UNHONOURED_KEY]
    assert entry["region"] == 0 and "feeds" in entry["reason"]
    assert not any(isinstance(n.target, CheckpointedRegion) for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), want)


def test_a_graph_without_regions_is_left_alone():
    x = torch.randn(4, 16)
    gm = export(nn.Linear(16, 4), x)
    code = gm.code
    assert not outline_checkpoints(gm).modified
    assert gm.code == code and UNHONOURED_KEY not in gm.meta
