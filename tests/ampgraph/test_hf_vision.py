"""HuggingFace transformers' windowed-attention vision models (Swin, Swin V2, Donut's Swin)
built from small configs (nothing downloaded), compiled at O2."""

from __future__ import annotations

import pytest
import torch

import ampgraph
from tests.helpers import cosine

transformers = pytest.importorskip("transformers")

SWINS = ("SwinModel", "Swinv2Model", "DonutSwinModel")


def small_swin(name: str) -> torch.nn.Module:
    config = getattr(transformers, name.replace("Model", "Config"))(
        image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
        window_size=4, drop_path_rate=0.0, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    return getattr(transformers, name)(config).eval()


def shape_symbols(gm: torch.fx.GraphModule) -> set:
    """The symbols the sizes of the graph's values are written in."""
    symbols = set()
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            for size in val.shape:
                if isinstance(size, torch.SymInt):
                    symbols |= size.node.expr.free_symbols
    return symbols


@pytest.mark.slow
@pytest.mark.parametrize("name", SWINS)
def test_hf_swin_compiles_whole_at_o2_with_static_image_sizes(name):
    """Export's symbolic image height and width through window partitions and padding took
    minutes (sympy); the image's sizes past the batch are static: the batch is the graph's
    one shape symbol, and the model is captured whole."""
    model = small_swin(name)
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, ref = net(pixel_values=x), model(pixel_values=x)
    graphs, eager = net.amp_parts()
    assert eager == [] and len(graphs) == 1, f"not captured whole: {eager}"
    captured = graphs[0][1].captured
    ((batch, *sizes),) = captured.dims
    assert isinstance(batch, tuple) and sizes == [3, 32, 32]
    assert len(shape_symbols(captured.gm)) == 1
    assert cosine(out.last_hidden_state, ref.last_hidden_state) >= 0.99
    assert cosine(out.pooler_output, ref.pooler_output) >= 0.99
    x3 = torch.randn(3, 3, 32, 32)  # another batch size reuses the graph
    with torch.no_grad():
        assert cosine(net(pixel_values=x3).last_hidden_state,
                      model(pixel_values=x3).last_hidden_state) >= 0.99
    assert sum(len(g) for g in net._amp_graphs.values()) == 1
