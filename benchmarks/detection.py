"""torchvision's detection and segmentation models through ampgraph O2 bf16 (issue 40, item 4).

    python benchmarks/detection.py                      # the six models, eval and train
    python benchmarks/detection.py --models faster_rcnn,deeplabv3 --json det.json

Random weights, small sizes (images ~64-96 px, a resnet18 or MobileNetV3 backbone, FPN
width 64, 3 classes, a few hundred proposals), one thread. torchvision's C ops do not load
with the pinned CPU torch: ``torchvision_ops.prepare()`` stands in a pure-torch ``nms`` and
puts roi_align's own pure-torch fallback back undecorated (docs/zoo.md).

Detectors cannot be exported whole (their box code is data-dependent): the root runs
eagerly in fp32 and each child is compiled on its own. Per model and mode it records:

- capture: what was compiled (module paths) and what stayed eager with export's reason,
  from ``net.amp_parts()``; the share of the compiled graphs' matrix and convolution FLOPs
  that run low (``ampgraph inspect``'s ``low_flops_share``), and the parameters no compiled
  graph holds (0: every weight is in a compiled part);
- eval numerics, cosine against fp32 beside autocast's: the backbone's features (every FPN
  level), and the class logits of the heads -- RetinaNet's and FCOS's dense heads; the R-CNN
  box predictor's on fixed proposals (the fp32 model's RPN proposals are given to each run,
  since 16-bit objectness scores reorder NMS and change the proposals), centred (less their
  mean: RetinaNet's and FCOS's classification bias starts at the prior -4.6, which alone
  makes any two runs' logits agree at cosine 1.0000); segmentation: the ``out`` logits.
  Detections after NMS differ in count, so they are not compared;
- train numerics: the loss terms' largest relative difference from fp32's and the cosine of
  all parameter gradients (of their sum; of a cross-entropy on fixed random labels for the
  segmenters), R-CNN proposals fixed the same way and the samplers seeded alike;
- seconds: O2's first eval and train call (captures included); a later train step of O2,
  autocast and fp32 (one each: noisy on a shared CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import inspect
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torchvision_ops  # benchmarks/, the script's folder, is on sys.path
from torch import nn

STAND_IN = torchvision_ops.prepare()  # before anything imports torchvision
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import zoo  # noqa: E402  (benchmarks/zoo.py: cosine, flat_grads, train_grads, ...)

import ampgraph  # noqa: E402
from ampgraph.cli.analysis import fx_stats  # noqa: E402
from passes.policy import LOW  # noqa: E402

CLASSES, FPN = 3, 64
RCNN = dict(min_size=64, max_size=96, rpn_pre_nms_top_n_train=200, rpn_post_nms_top_n_train=100,
            rpn_pre_nms_top_n_test=200, rpn_post_nms_top_n_test=100,
            box_batch_size_per_image=32, box_detections_per_img=20)
# a score threshold below the heads' prior (sigmoid(-4.6) = 0.01): NMS runs in eval
DENSE = dict(min_size=64, max_size=96, topk_candidates=100, detections_per_img=20,
             score_thresh=0.001)


# -- models ------------------------------------------------------------------------------


def resnet18_fpn(p6p7: bool) -> nn.Module:
    """resnet18 + FPN of width 64: C2-C5 and a max-pool level (R-CNNs), or C3-C5 and
    P6/P7 (RetinaNet, FCOS), as torchvision's resnet50 builders make them."""
    from torchvision.models import resnet18
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.ops.feature_pyramid_network import LastLevelMaxPool, LastLevelP6P7

    if p6p7:
        layers, extra = [2, 3, 4], LastLevelP6P7(FPN, FPN)
    else:
        layers, extra = [1, 2, 3, 4], LastLevelMaxPool()
    return BackboneWithFPN(resnet18(weights=None), {f"layer{k}": str(i) for i, k in
                                                    enumerate(layers)},
                           [64 * 2 ** (k - 1) for k in layers], FPN, extra_blocks=extra)


def faster_rcnn() -> nn.Module:
    from torchvision.models.detection import fasterrcnn_mobilenet_v3_large_fpn
    return fasterrcnn_mobilenet_v3_large_fpn(weights=None, weights_backbone=None,
                                             num_classes=CLASSES, **RCNN)


def mask_rcnn() -> nn.Module:
    from torchvision.models.detection import MaskRCNN
    return MaskRCNN(resnet18_fpn(p6p7=False), num_classes=CLASSES, **RCNN)


def retinanet() -> nn.Module:
    from torchvision.models.detection import RetinaNet
    return RetinaNet(resnet18_fpn(p6p7=True), num_classes=CLASSES, **DENSE)


def fcos() -> nn.Module:
    from torchvision.models.detection import FCOS
    return FCOS(resnet18_fpn(p6p7=True), num_classes=CLASSES, **DENSE)


def deeplabv3() -> nn.Module:
    from torchvision.models.segmentation import deeplabv3_mobilenet_v3_large
    return deeplabv3_mobilenet_v3_large(weights=None, weights_backbone=None,
                                        num_classes=CLASSES, aux_loss=False)


def lraspp() -> nn.Module:
    from torchvision.models.segmentation import lraspp_mobilenet_v3_large
    return lraspp_mobilenet_v3_large(weights=None, weights_backbone=None, num_classes=CLASSES)


@dataclass
class Model:
    build: Callable[[], nn.Module]
    kind: str  # "rcnn" | "dense" | "segmentation"
    masks: bool = False  # targets carry masks (Mask R-CNN)


MODELS = {
    "faster_rcnn": Model(faster_rcnn, "rcnn"),
    "mask_rcnn": Model(mask_rcnn, "rcnn", masks=True),
    "retinanet": Model(retinanet, "dense"),
    "fcos": Model(fcos, "dense"),
    "deeplabv3": Model(deeplabv3, "segmentation"),
    "lraspp": Model(lraspp, "segmentation"),
}


def images() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [torch.rand(3, 80, 72, generator=g), torch.rand(3, 64, 90, generator=g)]


def seg_inputs(model: nn.Module) -> dict[str, torch.Tensor]:
    """Two random 64 px images under the name of ``forward``'s argument (``x``, ``input``)."""
    name = next(iter(inspect.signature(model.forward).parameters))
    return {name: torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(4))}


def targets(masks: bool) -> list[dict[str, torch.Tensor]]:
    """Two boxes on the first image, one on the second (pixel corners of ``images()``)."""
    out = [dict(boxes=torch.tensor([[5.0, 6, 40, 50], [20, 10, 60, 70]]),
                labels=torch.tensor([1, 2])),
           dict(boxes=torch.tensor([[4.0, 2, 50, 40]]), labels=torch.tensor([2]))]
    if masks:
        for t, (h, w) in zip(out, ((80, 72), (64, 90))):
            m = torch.zeros(len(t["boxes"]), h, w, dtype=torch.uint8)
            for k, (x0, y0, x1, y1) in enumerate(t["boxes"].int().tolist()):
                m[k, y0:y1, x0:x1] = 1
            t["masks"] = m
    return out


def build(entry: Model) -> nn.Module:
    torch.manual_seed(0)
    model = zoo.no_dropout(entry.build())
    if entry.kind == "segmentation":
        zoo.prepare_weights(model, seg_inputs(model))
    else:  # batch-norm statistics of the backbone on normalised images (zoo.prepare_weights)
        batch = model.transform(images())[0].tensors
        zoo.prepare_weights(model.backbone, {"x": batch})
    if entry.kind == "dense":  # see spread_class_logits
        spread_class_logits(model.head.classification_head)
    return model.eval()


def spread_class_logits(head: nn.Module) -> None:
    """PyTorch's default init for the convolutions of RetinaNet's / FCOS's classification
    head (the biases keep theirs: 0, and the prior -4.6 for the logits). torchvision starts
    them at std 0.01: through RetinaNet's four convolutions the logits spread ~1e-3 around
    -4.6, under bf16's spacing there (2**-5), and all of them round to -4.59375 in bf16,
    autocast's and O2's alike; a trained head spreads them by units. (As
    ``zoo.prepare_weights`` gives a zero head random weights.)"""
    with torch.no_grad():
        for conv in head.modules():
            if isinstance(conv, nn.Conv2d):
                nn.init.kaiming_uniform_(conv.weight, a=5 ** 0.5)


# -- what each run computes ---------------------------------------------------------------


def original(module: nn.Module) -> nn.Module:
    """The user's module behind a compiled child (``AmpModule.original_module``)."""
    return getattr(module, "original_module", module)


@contextlib.contextmanager
def observed(model: nn.Module, kind: str, proposals: list | None) -> Any:
    """Record the backbone's features and the heads' class logits of a run (of the fp32
    model, under autocast, or of the compiled module, whose children are compiled parts of
    it); with ``proposals``, every RPN returns those (the fp32 run's) and its own losses."""
    from torchvision.models.detection.rpn import RegionProposalNetwork

    seen: dict[str, Any] = {}
    head = model.roi_heads.box_predictor if kind == "rcnn" else getattr(model, "head", None)

    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        user = original(module)
        if user is getattr(model, "backbone", None):
            seen["features"] = torch.cat([f.detach().float().flatten()
                                          for f in output.values()])
        elif user is head and head is not None:
            logits = (output[0] if kind == "rcnn" else output["cls_logits"]).detach().float()
            seen["logits"] = logits - logits.mean()  # centred: see the module docstring
        elif isinstance(module, RegionProposalNetwork):
            seen["proposals"] = [p.detach().clone() for p in output[0]]
            if proposals is not None:
                return proposals, output[1]
        return None

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def rounded(images: list[torch.Tensor]) -> list[torch.Tensor]:
    return [i.to(torch.bfloat16).float() for i in images]


def seg_labels(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        ref = zoo.logits_of(model(x))
    g = torch.Generator().manual_seed(5)
    rows = zoo.class_rows(ref)
    return torch.randint(0, rows.shape[1], (rows.shape[0],), generator=g)


def detection_step(model: nn.Module, call: Callable[[], dict]) -> tuple[dict, torch.Tensor]:
    """One train-mode step: the loss terms and the flat parameter gradients of their sum;
    the buffers a train-mode forward updates are put back (as ``zoo.train_grads``)."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    model.zero_grad(set_to_none=True)
    try:
        torch.manual_seed(1)  # the samplers draw alike in every run
        losses = call()
        sum(losses.values()).backward()
        return {k: float(v) for k, v in losses.items()}, zoo.flat_grads(model)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


def loss_gap(losses: dict, ref: dict) -> float:
    return max(abs(losses[k] - ref[k]) / max(abs(ref[k]), 1e-6) for k in ref)


def capture_summary(net: nn.Module, model: nn.Module) -> dict[str, Any]:
    graphs, eager = net.amp_parts()
    compiled = sorted({prefix for prefix, _ in graphs})
    low = sorted({prefix for prefix, c in graphs
                  if any(d.precision == LOW for d in c.decisions.values())})
    outside = 0 if "" in compiled else sum(
        p.numel() for name, p in model.named_parameters()
        if not any(name.startswith(f"{c}.") for c in compiled))
    return {"compiled_low": low, "compiled_fp32": [c for c in compiled if c not in low],
            "eager": [{"path": e.path, "module_type": e.module_type,
                                             "reason": e.reason} for e in eager],
            "low_flops_share": fx_stats(graphs)["low_flops_share"] if graphs else 0.0,
            "params_outside_graphs": outside}


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t0, 2)


# -- one model ----------------------------------------------------------------------------


def run_detector(name: str, entry: Model, model: nn.Module, row: dict) -> None:
    x, tg = images(), targets(entry.masks)
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    kind = entry.kind

    def eval_run(call: Callable[[], Any], proposals: list | None) -> dict:
        model.eval()
        with torch.no_grad(), observed(model, kind, proposals) as seen:
            seen["detections"] = [len(d["boxes"]) for d in call()]
        return seen

    ref = eval_run(lambda: model(x), None)
    fixed = ref.get("proposals")
    with zoo.autocast():
        ac = eval_run(lambda: model(x), fixed)
    o2, row["seconds"]["o2_eval_first"] = timed(lambda: eval_run(lambda: net(x), fixed))
    row["capture_eval"] = capture_summary(net, model)
    with zoo.bf16_rounded(model, {}):
        floor = eval_run(lambda: model(rounded(x)), fixed)
    for key in ("features", "logits"):
        row[f"eval_{key}_cos"] = {"O2": zoo.cosine(o2[key], ref[key]),
                                  "autocast": zoo.cosine(ac[key], ref[key]),
                                  "floor": zoo.cosine(floor[key], ref[key])}
    row["detections"] = {"fp32": ref["detections"], "autocast": ac["detections"],
                         "O2": o2["detections"]}

    def train_run(call: Callable[[], dict], proposals: list | None) -> tuple:
        model.train()
        with observed(model, kind, proposals) as seen:
            losses, grads = detection_step(model, call)
        return losses, grads, seen.get("proposals")

    def autocast_call() -> dict:
        with zoo.autocast():
            return model(x, tg)

    ref_losses, ref_grads, fixed = train_run(lambda: model(x, tg), None)
    ac_losses, ac_grads, _ = train_run(autocast_call, fixed)
    with zoo.bf16_rounded(model, {}):
        floor_losses, floor_grads, _ = train_run(lambda: model(rounded(x), tg), fixed)
    (o2_losses, o2_grads, _), row["seconds"]["o2_train_first"] = timed(
        lambda: train_run(lambda: net(x, tg), fixed))
    for key, call in (("fp32", lambda: model(x, tg)), ("autocast", autocast_call),
                      ("O2", lambda: net(x, tg))):  # a later step of each
        row["seconds"][f"{key}_train"] = timed(lambda c=call: train_run(c, fixed))[1]
    row["capture_train"] = capture_summary(net, model)
    row["train_loss_gap"] = {"O2": loss_gap(o2_losses, ref_losses),
                             "autocast": loss_gap(ac_losses, ref_losses),
                             "floor": loss_gap(floor_losses, ref_losses)}
    row["train_grad_cos"] = {"O2": zoo.cosine(o2_grads, ref_grads),
                             "autocast": zoo.cosine(ac_grads, ref_grads),
                             "floor": zoo.cosine(floor_grads, ref_grads)}
    row["losses"] = {"fp32": ref_losses, "autocast": ac_losses, "O2": o2_losses}
    model.eval()


def run_segmenter(name: str, entry: Model, model: nn.Module, row: dict) -> None:
    inputs = seg_inputs(model)
    x = next(iter(inputs.values()))
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16")
    model.eval()
    with torch.no_grad():
        ref = zoo.logits_of(model(x)).float()
        with zoo.autocast():
            ac = zoo.logits_of(model(x)).float()
        o2, row["seconds"]["o2_eval_first"] = timed(lambda: zoo.logits_of(net(x)).float())
    row["capture_eval"] = capture_summary(net, model)
    labels = seg_labels(model, x)
    model.train()
    ref_grads = zoo.train_grads(model, lambda: model(x), labels)
    floors: dict[str, Any] = {"errors": {}, "notes": [], "seconds": {}}
    zoo.bf16_floors(model, inputs, labels, ref, ref_grads, floors)
    row["eval_logits_cos"] = {"O2": zoo.cosine(o2, ref), "autocast": zoo.cosine(ac, ref),
                              "floor": floors["bf16_floor_eval_cos"]}
    model.train()

    def autocast_call() -> Any:
        with zoo.autocast():
            return model(x)

    ac_grads = zoo.train_grads(model, autocast_call, labels)
    o2_grads, row["seconds"]["o2_train_first"] = timed(
        lambda: zoo.train_grads(model, lambda: net(x), labels))
    for key, call in (("fp32", lambda: model(x)), ("autocast", autocast_call),
                      ("O2", lambda: net(x))):  # a later step of each
        row["seconds"][f"{key}_train"] = timed(
            lambda c=call: zoo.train_grads(model, c, labels))[1]
    row["capture_train"] = capture_summary(net, model)
    row["train_grad_cos"] = {"O2": zoo.cosine(o2_grads, ref_grads),
                             "autocast": zoo.cosine(ac_grads, ref_grads),
                             "floor": floors["bf16_floor_grad_cos"]}
    model.eval()


def run_model(name: str) -> dict[str, Any]:
    entry = MODELS[name]
    row: dict[str, Any] = {"model": name, "kind": entry.kind, "seconds": {}, "errors": {}}
    t0 = time.perf_counter()
    try:
        with zoo.quiet():
            model = build(entry)
            row["params"] = sum(p.numel() for p in model.parameters())
            (run_segmenter if entry.kind == "segmentation" else run_detector)(
                name, entry, model, row)
    except Exception as exc:  # noqa: BLE001 - the benchmark records and goes on
        row["errors"]["run"] = zoo.one_line(exc)
        if os.environ.get("ZOO_TRACEBACK"):
            raise
    row["seconds"]["total"] = round(time.perf_counter() - t0, 2)
    return row


# -- output ------------------------------------------------------------------------------


def pair(v: dict | None, fmt: str = "{:.5f}") -> str:
    """``O2 (autocast; bf16 floor)``."""
    if not v:
        return "-"
    floor = f"; {fmt.format(v['floor'])}" if v.get("floor") is not None else ""
    return f"{fmt.format(v['O2'])} ({fmt.format(v['autocast'])}{floor})"


def table(rows: list[dict]) -> str:
    head = ("| model | compiled, low | compiled, fp32 | eager (fp32) | low FLOPs | eval "
            "features cos | eval logits cos | train grad cos | train loss gap | O2 first "
            "eval / train s | train step s O2 / autocast / fp32 |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        cap = r.get("capture_train") or r.get("capture_eval") or {}
        eager = ", ".join(f"`{e['path']}`" for e in cap.get("eager", [])) or "none"
        low_parts, fp32_parts = (", ".join(f"`{c or '<root>'}`" for c in cap.get(k, [])) or "-"
                                 for k in ("compiled_low", "compiled_fp32"))
        s = r["seconds"]
        low = cap.get("low_flops_share")
        lines.append(
            f"| {r['model']} | {low_parts} | {fp32_parts} | {eager} | "
            f"{'-' if low is None else f'{100 * low:.1f}%'} | "
            f"{pair(r.get('eval_features_cos'))} | {pair(r.get('eval_logits_cos'))} | "
            f"{pair(r.get('train_grad_cos'))} | {pair(r.get('train_loss_gap'), '{:.2e}')} | "
            f"{s.get('o2_eval_first', '-')} / {s.get('o2_train_first', '-')} | "
            f"{s.get('O2_train', '-')} / {s.get('autocast_train', '-')} / "
            f"{s.get('fp32_train', '-')} |")
    return "\n".join(lines)


def details(rows: list[dict]) -> str:
    out = []
    for r in rows:
        seen = set()
        for mode in ("capture_eval", "capture_train"):
            for e in (r.get(mode) or {}).get("eager", []):
                if (e["path"], e["reason"]) not in seen:
                    seen.add((e["path"], e["reason"]))
                    out.append(f"- {r['model']} ({mode[8:]}): eager `{e['path']}` "
                               f"({e['module_type']}): {e['reason'][:160]}")
        if "detections" in r:
            out.append(f"- {r['model']}: detections per image fp32 / autocast / O2: "
                       f"{r['detections']['fp32']} / {r['detections']['autocast']} / "
                       f"{r['detections']['O2']}")
        for step_name, err in r["errors"].items():
            out.append(f"- {r['model']} {step_name}: {err}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated (default: all): {','.join(MODELS)}")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = zoo.chosen(parser, args.models, MODELS)
    rows = []
    for name in names:
        rows.append(run_model(name))
        print(f"[{name}] {rows[-1]['seconds']['total']} s", file=sys.stderr, flush=True)
    print(table(rows))
    print("\nO2 (autocast; bf16 floor) in each cell: cosines against fp32; loss gap: the "
          "largest relative difference of a loss term from fp32's; bf16 floor: fp32 on weights "
          "and images rounded to bf16 once (zoo.py). torchvision ops: "
          f"{STAND_IN or 'the C ops loaded'}")
    more = details(rows)
    if more:
        print("\n" + more)
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "command": " ".join(["python", "benchmarks/detection.py",
                                     *(argv if argv is not None else sys.argv[1:])]),
                "threads": torch.get_num_threads(), "torchvision_ops": STAND_IN}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "models": rows}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
