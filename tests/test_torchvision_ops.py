"""benchmarks/torchvision_ops.py's pure-torch ``nms`` (the stand-in for torchvision's C op,
which does not load with the pinned CPU torch) against a naive greedy suppression. Needs
only torch: it runs everywhere, torchvision or not."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "torchvision_ops.py"
_spec = importlib.util.spec_from_file_location("torchvision_ops", PATH)
torchvision_ops = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(torchvision_ops)


def naive_nms(boxes: torch.Tensor, scores: torch.Tensor, threshold: float) -> list[int]:
    """Greedy suppression in Python floats: by decreasing score (ties: lower index first),
    a box is kept unless its IoU with a kept box exceeds the threshold."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    b = boxes.double().tolist()

    def iou(i: int, j: int) -> float:
        w = max(0.0, min(b[i][2], b[j][2]) - max(b[i][0], b[j][0]))
        h = max(0.0, min(b[i][3], b[j][3]) - max(b[i][1], b[j][1]))
        inter = w * h
        union = ((b[i][2] - b[i][0]) * (b[i][3] - b[i][1])
                 + (b[j][2] - b[j][0]) * (b[j][3] - b[j][1]) - inter)
        return inter / union if union > 0 else 0.0

    kept: list[int] = []
    for i in order:
        if all(iou(i, j) <= threshold for j in kept):
            kept.append(i)
    return kept


def random_boxes(n: int, seed: int, levels: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    corner = torch.rand(n, 2, generator=g) * 100
    size = torch.rand(n, 2, generator=g) * 40 + 1
    boxes = torch.cat([corner, corner + size], dim=1)
    scores = torch.rand(n, generator=g)
    if levels is not None:  # few distinct scores: many ties
        scores = (scores * levels).floor() / levels
    return boxes, scores


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.7])
@pytest.mark.parametrize("n,levels", [(1, None), (20, None), (300, None), (300, 4), (60, 1)])
def test_nms_keeps_what_a_naive_greedy_suppression_keeps(n, levels, threshold):
    boxes, scores = random_boxes(n, seed=n + (levels or 0), levels=levels)
    kept = torchvision_ops.nms(boxes, scores, threshold)
    assert kept.dtype == torch.int64
    assert kept.tolist() == naive_nms(boxes, scores, threshold)


def test_nms_on_duplicates_ties_and_an_iou_equal_to_the_threshold():
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 5], [20, 20, 30, 30],
                          [20, 20, 30, 30]])
    scores = torch.tensor([0.5, 0.5, 0.9, 0.5, 0.7])
    # box 2 is half of box 0: IoU exactly 0.5, not above the threshold: both kept
    assert torchvision_ops.nms(boxes, scores, 0.5).tolist() == [2, 4, 0] \
        == naive_nms(boxes, scores, 0.5)
    assert torchvision_ops.nms(boxes, scores, 0.4).tolist() == [2, 4] \
        == naive_nms(boxes, scores, 0.4)


def test_nms_of_no_boxes_is_an_empty_index_tensor():
    kept = torchvision_ops.nms(torch.empty(0, 4), torch.empty(0), 0.5)
    assert kept.shape == (0,) and kept.dtype == torch.int64
