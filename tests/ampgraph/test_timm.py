"""timm models through O2 bf16, representatives of ``benchmarks/timm_sweep.py`` (docs/zoo.md
"Across timm's families"): a ViT, a ConvNeXt, an EfficientNet (batch norm) and a Swin, tiny
and random, captured whole in eval and train mode, their logits and gradients agreeing with
fp32 as autocast's do. Runs where timm is installed (the zoo environment); the measurements
are the zoo's own (``benchmarks/zoo.py``, which prepares torchvision before timm imports it).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

import ampgraph

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import zoo  # noqa: E402 - torchvision_ops.prepare() before timm imports torchvision

timm = pytest.importorskip("timm")


def swin() -> torch.nn.Module:  # two stages, windows of 4 at 32 px
    return timm.models.swin_transformer.SwinTransformer(
        img_size=32, patch_size=4, window_size=4, embed_dim=16, depths=(1, 1),
        num_heads=(1, 2), num_classes=zoo.LABELS)


# name -> (builder, image size, batch): batch-norm models at 64 px and 4 images, as the zoo
CASES = {
    "test_vit": (lambda: timm.create_model("test_vit", num_classes=zoo.LABELS, img_size=32),
                 32, 2),
    "test_convnext": (lambda: timm.create_model("test_convnext", num_classes=zoo.LABELS), 32, 2),
    "test_efficientnet": (lambda: timm.create_model("test_efficientnet",
                                                    num_classes=zoo.LABELS), 64, 4),
    "swin": (swin, 32, 2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_o2_captures_whole_and_agrees_with_fp32_as_autocast(name, one_thread):
    build, size, batch = CASES[name]
    torch.manual_seed(0)
    model = zoo.no_dropout(build())
    inputs = zoo.images(size, batch)()
    zoo.prepare_weights(model, inputs)
    model.eval()
    with torch.no_grad():
        ref = model(**inputs)
        with zoo.autocast():
            ac = zoo.cosine(model(**inputs).float(), ref)
    labels = torch.randint(0, zoo.LABELS, (batch,), generator=torch.Generator().manual_seed(5))
    model.train()
    ref_grads = zoo.train_grads(model, lambda: model(**inputs), labels)

    def autocast_call() -> torch.Tensor:
        with zoo.autocast():
            return model(**inputs)
    ac_grad = zoo.cosine(zoo.train_grads(model, autocast_call, labels), ref_grads)

    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    net.eval()
    with torch.no_grad():
        out = net(**inputs)
    assert zoo.describe_capture(net)["status"] == "whole graph"
    o2 = zoo.cosine(out, ref)
    assert o2 >= 0.99 and o2 >= ac - 0.005, (o2, ac)
    net.train()
    grads = zoo.train_grads(model, lambda: net(**inputs), labels)
    assert zoo.describe_capture(net)["status"] == "whole graph"
    assert torch.isfinite(grads).all()
    o2_grad = zoo.cosine(grads, ref_grads)
    assert o2_grad >= ac_grad - 0.01, (o2_grad, ac_grad)
