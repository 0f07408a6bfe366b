"""torchvision's detectors and segmenters through O2 bf16, representatives of
``benchmarks/detection.py`` (docs/zoo.md "torchvision detection and segmentation"): a tiny
Faster R-CNN with an FPN, whose box code is data-dependent (the root, its transform, RPN and
RoI heads run eagerly in fp32, the backbone, FPN and heads compiled low, the RoI pooling
compiled in fp32), in eval and train; a DeepLabV3, captured whole. Runs where torchvision
is installed (the zoo environment), after ``torchvision_ops.prepare()`` (its C ops do not
load with the pinned CPU torch: a pure-torch nms stands in).
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch
from torch import nn

import ampgraph

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import zoo  # noqa: E402 - torchvision_ops.prepare() before anything imports torchvision

torchvision = pytest.importorskip("torchvision")

pytestmark = pytest.mark.usefixtures("one_thread")

RULE_8 = "eager fallback part without a matrix product"


def tiny_faster_rcnn() -> nn.Module:
    """Two conv stages, an FPN of width 16 on both and a max-pool level, 3 classes."""
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.anchor_utils import AnchorGenerator
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.models.detection.faster_rcnn import FastRCNNPredictor, TwoMLPHead
    from torchvision.ops import MultiScaleRoIAlign

    torch.manual_seed(0)
    body = nn.Sequential(nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU())
    backbone = BackboneWithFPN(body, {"2": "0", "4": "1"}, [16, 32], 16)
    return FasterRCNN(
        backbone, min_size=64, max_size=96,
        rpn_anchor_generator=AnchorGenerator(((16,), (32,), (64,)), ((0.5, 1.0, 2.0),) * 3),
        box_roi_pool=MultiScaleRoIAlign(["0", "1"], 7, 2),
        box_head=TwoMLPHead(16 * 49, 64), box_predictor=FastRCNNPredictor(64, 3),
        rpn_pre_nms_top_n_train=100, rpn_post_nms_top_n_train=50,
        rpn_pre_nms_top_n_test=100, rpn_post_nms_top_n_test=50,
        box_batch_size_per_image=32, box_detections_per_img=10)


def images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.rand(3, 80, 72, generator=g), torch.rand(3, 64, 90, generator=g)]


TARGETS = [dict(boxes=torch.tensor([[5.0, 6, 40, 50], [20, 10, 60, 70]]),
                labels=torch.tensor([1, 2])),
           dict(boxes=torch.tensor([[4.0, 2, 50, 40]]), labels=torch.tensor([2]))]


def rows_of(report: ampgraph.PrecisionReport, prefix: str) -> list[dict]:
    return [r for r in report.nodes if r["module"].startswith(prefix)]


def test_faster_rcnn_runs_its_backbone_and_heads_low_and_its_box_code_eagerly_in_fp32():
    model = tiny_faster_rcnn().eval()
    net = ampgraph.compile(model, "O2", "bf16")
    x = images()
    with pytest.warns(UserWarning, match="could not be captured whole"), torch.no_grad():
        detections = net(x)
    assert len(detections) == 2
    assert all(d["boxes"].dtype == torch.float32 and d["scores"].dtype == torch.float32
               for d in detections), "the box code's outputs are fp32"
    report = ampgraph.explain(net)
    eager = {e.path for e in report.eager}
    assert {"<root>", "transform", "rpn", "rpn.anchor_generator", "roi_heads"} <= eager
    assert not any(p.startswith(("backbone", "rpn.head", "roi_heads.box_")) for p in eager)
    for prefix, op in (("backbone", "aten.conv"), ("rpn.head", "aten.conv"),
                       ("roi_heads.box_head", "aten.linear"),
                       ("roi_heads.box_predictor", "aten.linear")):
        products = [r for r in rows_of(report, prefix) if r["op"].startswith(op)]
        assert products and {r["precision"] for r in products} == {"bf16"}, prefix
    pooling = [r for r in rows_of(report, "roi_heads.box_roi_pool")
               if r["precision"] != "n/a" and r["op"].startswith("aten.")]
    assert pooling and {r["precision"] for r in pooling} == {"fp32"}
    assert any(RULE_8 in r["reason"] for r in pooling), "box coordinates kept fp32, and why"

    model.train()  # the user's model: the eager box code follows it into train mode
    torch.manual_seed(1)
    losses = net(x, TARGETS)
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_objectness",
                           "loss_rpn_box_reg"}
    assert all(torch.isfinite(v) and v.dtype == torch.float32 for v in losses.values())
    sum(losses.values()).backward()
    for p in (model.backbone.body["0"].weight, model.backbone.fpn.layer_blocks[0][0].weight,
              model.rpn.head.cls_logits.weight, model.roi_heads.box_predictor.cls_score.weight):
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0
    torch.manual_seed(1)
    with torch.no_grad():
        ref = model(x, TARGETS)
    for key in ("loss_objectness", "loss_rpn_box_reg"):  # the same anchors, sampled alike
        assert abs(float(losses[key]) - float(ref[key])) <= 0.03 * abs(float(ref[key])), key


def test_deeplabv3_is_captured_whole_and_agrees_with_fp32_in_eval_and_train():
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large

    torch.manual_seed(0)
    model = deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=3,
                                         aux_loss=False)
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    zoo.prepare_weights(model, {"x": x})  # batch-norm statistics of other random images
    model.eval()
    net = ampgraph.compile(model, "O2", "bf16")
    with torch.no_grad():
        out = net(x)["out"]
        ref = model(x)["out"]
    assert out.dtype == torch.float32 and out.shape == (2, 3, 64, 64)
    assert zoo.cosine(out, ref) >= 0.99
    assert ampgraph.explain(net).eager == []
    convs = [r for r in ampgraph.explain(net).nodes if r["op"].startswith("aten.conv")]
    assert convs and {r["precision"] for r in convs} == {"bf16"}
    net.train()
    labels = torch.randint(0, 3, (2 * 64 * 64,), generator=torch.Generator().manual_seed(5))
    grads = zoo.train_grads(model, lambda: net(x), labels)
    assert torch.isfinite(grads).all() and grads.abs().sum() > 0
    assert ampgraph.explain(net).eager == []
