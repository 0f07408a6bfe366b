"""torchvision on the pinned CPU torch, whose wheel's C ops do not load (REFERENCE.md section 9).

torchvision's wheel on the package index links the CUDA torch build; with the pinned CPU
torch its ``_C`` library does not load. torchvision tolerates that by itself
(``torchvision.extension._has_ops()`` is then False; ``roi_align`` then runs its own
pure-torch ``_roi_align``, and an op such as ``nms`` raises only when called), except for
one module: ``torchvision._meta_registrations`` registers fake kernels for
``torchvision::nms`` & co. unconditionally at import and raises "operator torchvision::nms
does not exist". transformers and timm import torchvision whenever it is installed, so
every import would fail.

``prepare()`` -- called before anything imports torchvision -- first tries to load
torchvision's ``_C`` itself. A torchvision whose ops load is imported untouched. Otherwise:

- an empty module stands in for ``torchvision._meta_registrations``;
- ``torchvision.ops.nms`` (and ``torchvision.ops.boxes.nms``, which ``batched_nms`` and the
  detection models call) becomes ``nms`` below: the same greedy suppression as torchvision's
  CPU kernel (boxes sorted by descending score, a box dropped when its IoU with a kept
  higher-scoring box exceeds the threshold), written in torch ops.

No other C op is needed by the models we run: ``roi_align`` (Faster/Mask R-CNN) falls back
to torchvision's own pure-torch ``_roi_align``, ``roi_pool``/``ps_roi_*``/``deform_conv2d``
are not used by them. torchvision wraps that ``_roi_align`` in a lazy ``torch.compile``
(inductor on its first call: 10-30 s on our CPUs, again for each new mode); ``prepare()``
puts the plain function back (``__wrapped__``): the same ops, run eagerly.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import types

import torch

NMS_STAND_IN = "pure-torch nms (torchvision's C ops do not load with this torch)"


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou_threshold: float) -> torch.Tensor:
    """torchvision's CPU ``nms`` in torch ops: indices kept, by decreasing score."""
    if boxes.numel() == 0:
        return torch.empty((0,), dtype=torch.int64, device=boxes.device)
    order = torch.sort(scores, descending=True, stable=True).indices
    b = boxes[order].double()
    area = (b[:, 2] - b[:, 0]) * (b[:, 3] - b[:, 1])
    lt = torch.maximum(b[:, None, :2], b[None, :, :2])
    rb = torch.minimum(b[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp(min=0).prod(dim=2)
    over = (inter / (area[:, None] + area[None, :] - inter)) > iou_threshold
    suppressed = torch.zeros(len(order), dtype=torch.bool)
    keep = []
    for i, row in enumerate(over.tolist()):
        if suppressed[i]:
            continue
        keep.append(i)
        suppressed |= torch.tensor(row)
    return order[torch.tensor(keep, dtype=torch.int64, device=boxes.device)]


def _c_ops_load() -> bool | None:
    """None: torchvision is not installed; else whether its ``_C`` library loads."""
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        lib = os.path.join(folder, "_C.so")
        if os.path.exists(lib):
            try:
                torch.ops.load_library(lib)
                return True
            except OSError:
                return False
    return False


def prepare() -> str | None:
    """Make torchvision importable here; the stand-in used (a note for reports) or None."""
    loads = _c_ops_load()
    if loads is None or loads:
        return None
    sys.modules.setdefault("torchvision._meta_registrations",
                           types.ModuleType("torchvision._meta_registrations"))
    import torchvision.ops
    import torchvision.ops.boxes
    import torchvision.ops.roi_align

    torchvision.ops.boxes.nms = nms
    torchvision.ops.nms = nms
    roi_align = sys.modules["torchvision.ops.roi_align"]  # the attribute is the function
    roi_align._roi_align = getattr(roi_align._roi_align, "__wrapped__", roi_align._roi_align)
    return NMS_STAND_IN
