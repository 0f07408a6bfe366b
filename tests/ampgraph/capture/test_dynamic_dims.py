"""ampgraph/capture/dynamic_dims.py: the dynamic dims torch.export is asked for (an image's
static past its batch)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.export import Dim
from torch.utils import _pytree as pytree

import ampgraph
from ampgraph.capture.dynamic_dims import dynamic_spec, image_channels, is_image, static_retry
from ampgraph.capture.export import export_module
from tests.helpers import cosine


def test_dynamic_spec_marks_every_dimension_auto():
    spec = dynamic_spec(((torch.ones(2, 3), 1.0), {"mask": torch.ones(4), "k": None}))
    assert spec[0][0] == {0: Dim.AUTO, 1: Dim.AUTO} and spec[0][1] is None
    assert spec[1] == {"mask": {0: Dim.AUTO}, "k": None}


class Patches(nn.Module):
    """A patch embedding (a 2-D convolution over 3-channel images) and a head."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Conv2d(3, 8, 4, stride=4)
        self.head = nn.Linear(8, 5)

    def forward(self, pixel_values):
        return self.head(self.embed(pixel_values).flatten(2).mean(-1))


def test_image_channels_are_the_convolutions_inputs_by_rank():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv3d(1, 4, 3), nn.Conv1d(5, 5, 1),
                          nn.Linear(4, 4))
    assert image_channels(model) == {(4, 3), (5, 1)}
    assert image_channels(nn.Linear(4, 4)) == frozenset()


def test_an_image_is_a_floating_batch_a_convolution_takes():
    images = frozenset({(4, 3), (5, 1)})
    assert is_image(torch.randn(2, 3, 8, 8), images)
    assert is_image(torch.randn(2, 1, 4, 8, 8), images)
    assert not is_image(torch.randn(2, 4, 8, 8), images)  # another channel count
    assert not is_image(torch.randn(2, 3, 8), images)  # another rank
    assert not is_image(torch.ones(2, 3, 8, 8, dtype=torch.long), images)  # not floating
    assert not is_image(torch.randn(3), images) and not is_image(3, images)


def test_dynamic_spec_keeps_an_image_argument_static_past_its_batch():
    images = image_channels(Patches())
    x, mask = torch.randn(2, 3, 16, 16), torch.ones(2, 7)
    spec = dynamic_spec(((x, mask), {"pixel_values": x, "nested": [x]}), images)
    assert spec[0] == ({0: Dim.AUTO}, {0: Dim.AUTO, 1: Dim.AUTO})
    assert spec[1]["pixel_values"] == {0: Dim.AUTO}
    # inside a container (a cache's tensors, a list) every dimension stays dynamic
    assert spec[1]["nested"] == [{i: Dim.AUTO for i in range(4)}]
    # without images, as without a model: every dimension
    assert dynamic_spec(((x,), {}))[0][0] == {i: Dim.AUTO for i in range(4)}


def test_a_model_of_images_keeps_a_dynamic_batch_and_captures_each_image_size():
    torch.manual_seed(0)
    model = Patches().eval()
    captured = export_module(model, (torch.randn(2, 3, 16, 16),), {})
    ((batch, *sizes),) = captured.dims
    assert isinstance(batch, tuple) and sizes == [3, 16, 16]
    net = ampgraph.compile(model, amp_level="O2")
    with torch.no_grad():
        for n, size in ((2, 16), (5, 16), (3, 32), (4, 16)):
            x = torch.randn(n, 3, size, size)
            assert cosine(net(x), model(x)) > 0.99
    (graphs,) = net._amp_graphs.values()
    assert len(graphs) == 2  # one per image size; batch sizes share it


def test_dynamic_spec_follows_the_inputs_containers_exactly():
    x = torch.ones(2)
    spec = dynamic_spec(((x, (x, 1), [x, None]), {"shape": (2, 3), "opts": [1.0]}))
    assert type(spec[0][1]) is tuple and spec[0][1][1] is None
    assert type(spec[0][2]) is list and spec[0][2][1] is None
    assert spec[1] == {"shape": (None, None), "opts": [None]}
    assert type(spec[1]["shape"]) is tuple and type(spec[1]["opts"]) is list


class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b


class Product(nn.Module):
    def forward(self, pair):
        return pair.a * pair.b


def test_dynamic_spec_of_a_registered_node_is_the_sequence_its_flatten_returns():
    pytree.register_pytree_node(
        Pair, lambda p: ((p.a, p.b), None), lambda children, _: Pair(*children),
        flatten_with_keys_fn=lambda p: (((pytree.GetAttrKey("a"), p.a),
                                         (pytree.GetAttrKey("b"), p.b)), None))
    try:
        spec = dynamic_spec(((Pair(torch.ones(2), 3.0),), {}))
        captured = export_module(Product(), (Pair(torch.ones(2), 3.0),), {})  # a list: refused
    finally:
        pytree._deregister_pytree_node(Pair)
    assert spec[0][0] == ({0: Dim.AUTO}, None) and type(spec[0][0]) is tuple
    assert len(captured.dims) == 1 and not isinstance(captured.dims[0][0], int)


def test_static_retry_is_for_guards_on_sizes_not_on_data():
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    def error(text: str) -> GuardOnDataDependentSymNode:
        return GuardOnDataDependentSymNode(None, f"Could not guard on data-dependent "
                                                 f"expression {text}.  (Size-like symbols: "
                                                 "none)\n\nconsider ...")
    assert static_retry(error("8*u1 < 16 (unhinted: 8*u1 < s27 + (Mod(8 - (Mod(s27, 8)), 8)))"))
    assert not static_retry(error("Eq(u0, 0) (unhinted: Eq(u0, 0))"))
    assert not static_retry(RuntimeError("8*u1 < 16 (unhinted: 8*u1 < s27).  (Size-like symbols"))


def test_window_sizes_computed_through_tensors_are_captured_with_static_sizes():
    """Longformer's sliding-window attention chunks with ``torch.div(size, 2w)`` as a view
    size: on dynamic sizes export fails (``8*u1 < 16``) and the module ran eagerly."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.longformer.modeling_longformer import LongformerSelfAttention

    cfg = transformers.LongformerConfig(hidden_size=32, num_attention_heads=2,
                                        attention_window=[8])
    torch.manual_seed(0)
    attn = LongformerSelfAttention(cfg, layer_id=0).eval()
    net = ampgraph.compile(attn, amp_level="O2", dtype="bf16")
    x = torch.randn(2, 16, 32)
    mask = torch.zeros(2, 1, 1, 16)[:, 0, 0, :]  # a view, as LongformerModel passes it
    kw = dict(attention_mask=mask, is_index_masked=mask < 0, is_index_global_attn=mask > 0,
              is_global_attn=False)
    with torch.no_grad():
        out, ref = net(x, **kw)[0], attn(x, **kw)[0]
    graphs, eager = net.amp_parts()
    assert graphs and not eager, [e.reason for e in eager]
    assert cosine(out, ref) > 0.999
