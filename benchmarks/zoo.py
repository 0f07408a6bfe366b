"""A zoo of real third-party models (tiny random configs) run through ampgraph on demand.

    python benchmarks/zoo.py                          # every registered model
    python benchmarks/zoo.py --models bert,gpt2 --skip-onnx --skip-speed --json zoo.json
    python benchmarks/zoo.py --quick                  # a small fast subset (the smoke test)

Nothing is downloaded: every model is built from a shrunk config with random weights
(hidden 32, 2 layers, batch 2, sequence 12, 32 px images), every dropout probability 0.
Per model it records (see docs/zoo.md):

- capture: "whole graph", "partly eager" (which modules and why, from ``net.amp_parts()``)
  or "failed" (the error);
- O2 bf16 eval: cosine of the logits vs fp32, beside torch.autocast(bf16)'s;
- train mode: cosine of all parameter gradients (one flat vector) vs fp32 for a
  cross-entropy loss on the logits with fixed random labels, beside autocast's;
- ONNX: ``ampgraph.export_onnx`` (O2, fp16) on onnxruntime CPU vs the fp32 logits, beside
  onnxconverter-common's ``convert_float_to_float16(keep_io_types=True)`` of an fp32 export;
- speed: autocast time / O2 time for inference and forward+backward (median of a few
  interleaved repeats; >1 means O2 is faster). Tiny models on a shared CPU: noisy.

Every step is guarded: a failure records its error (one line) and the zoo goes on. Adding a
model is one ``ZOO`` entry: a builder returning the fp32 module, an input maker returning a
dict of keyword inputs, and a family. Builders for libraries that are not installed
(torchvision, timm) give a row marked "not available" with the import error.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import logging
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torchvision_ops  # benchmarks/, the script's folder, is on sys.path
from torch import nn

torchvision_ops.prepare()  # before transformers or timm import torchvision
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import ampgraph  # noqa: E402

BATCH, SEQ, VOCAB, IMG, LABELS = 2, 12, 128, 32, 5
HF_SMALL = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
HF_NODROP = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


class NotAvailable(Exception):
    """The model's library is not installed or does not import."""


@dataclass
class Entry:
    builder: Callable[[], nn.Module]
    inputs: Callable[[], dict[str, torch.Tensor]]
    family: str


# -- input makers ------------------------------------------------------------------------


def text_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones(BATCH, SEQ, dtype=torch.long)}


def ids_only() -> dict[str, torch.Tensor]:
    return {"input_ids": text_inputs()["input_ids"]}


def seq2seq_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    out = text_inputs()
    out["decoder_input_ids"] = torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)
    return out


def image_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"pixel_values": torch.randn(BATCH, 3, IMG, IMG, generator=g)}


def whisper_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(4)
    return {"input_features": torch.randn(BATCH, 16, 32, generator=g),
            "decoder_input_ids": torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)}


def images(size: int = IMG, batch: int = BATCH) -> Callable[[], dict[str, torch.Tensor]]:
    """torchvision/timm models: ``forward(x)`` on a batch of ``size`` px images."""
    def make() -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(3)
        return {"x": torch.randn(batch, 3, size, size, generator=g)}
    return make


# Batch-norm CNNs downsample 32x: at 32 px and batch 2 their last stages normalise over 2
# values per channel, which makes train-mode gradients (and eval after calibration) noise.
BN_IMAGES = images(64, 4)


# -- builders ----------------------------------------------------------------------------


def hf(model_cls: str, config_cls: str, **config: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        torch.manual_seed(0)
        cfg = getattr(transformers, config_cls)(**config)
        return getattr(transformers, model_cls)(cfg)
    return build


def no_dropout(model: nn.Module) -> nn.Module:
    """Every dropout and stochastic-depth probability 0, so train-mode runs are deterministic
    (torchvision's ``StochasticDepth.p``, timm's ``DropPath.drop_prob``)."""
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        elif type(m).__name__ == "StochasticDepth":
            m.p = 0.0
        elif type(m).__name__ == "DropPath":
            m.drop_prob = 0.0
    return model


def torchvision_model(make: str | Callable[[Any], nn.Module],
                      **kwargs: Any) -> Callable[[], nn.Module]:
    """``make``: a builder's name in ``torchvision.models`` (called with ``weights=None``), or
    a function of the ``torchvision`` module for models built from their classes."""
    def build() -> nn.Module:
        try:
            import torchvision
        except Exception as exc:  # noqa: BLE001 - a broken wheel raises more than ImportError
            raise NotAvailable(f"torchvision: {one_line(exc)}") from exc
        torch.manual_seed(0)
        if callable(make):
            return no_dropout(make(torchvision))
        builder = torchvision.models
        for part in make.split("."):  # e.g. "segmentation.deeplabv3_mobilenet_v3_large"
            builder = getattr(builder, part)
        return no_dropout(builder(weights=None, **kwargs))
    return build


def timm_model(make: str | Callable[[Any], nn.Module], **kwargs: Any) -> Callable[[], nn.Module]:
    """``make``: a ``timm.create_model`` name (kwargs override its config), or a function of
    the ``timm`` module."""
    def build() -> nn.Module:
        try:
            import timm
        except Exception as exc:  # noqa: BLE001
            raise NotAvailable(f"timm: {one_line(exc)}") from exc
        torch.manual_seed(0)
        if callable(make):
            return no_dropout(make(timm))
        return no_dropout(timm.create_model(make, pretrained=False, **kwargs))
    return build


def timm_mixer(timm: Any) -> nn.Module:  # the mixer_* names fix patch size and depth
    return timm.models.mlp_mixer.MlpMixer(num_classes=LABELS, img_size=IMG, patch_size=8,
                                          num_blocks=2, embed_dim=32)


def tv_vit(tv: Any) -> nn.Module:
    return tv.models.VisionTransformer(image_size=IMG, patch_size=8, num_layers=2, num_heads=2,
                                       hidden_dim=32, mlp_dim=64, num_classes=LABELS)


def tv_swin(tv: Any) -> nn.Module:
    return tv.models.SwinTransformer(patch_size=[4, 4], embed_dim=16, depths=[1, 1],
                                     num_heads=[2, 2], window_size=[4, 4],
                                     stochastic_depth_prob=0.0, num_classes=LABELS)


def tv_convnext(tv: Any) -> nn.Module:
    cfg = tv.models.convnext.CNBlockConfig
    return tv.models.ConvNeXt([cfg(16, 32, 1), cfg(32, None, 1)], stochastic_depth_prob=0.0,
                              num_classes=LABELS)


def tv_densenet(tv: Any) -> nn.Module:
    return tv.models.DenseNet(growth_rate=8, block_config=(2, 2, 2, 2), num_init_features=16,
                              bn_size=2, num_classes=LABELS)


def tv_fcn(tv: Any) -> nn.Module:
    """FCN head on a ResNet-18 backbone (torchvision builds FCN on ResNet-50/101 only)."""
    from torchvision.models._utils import IntermediateLayerGetter
    from torchvision.models.segmentation.fcn import FCN, FCNHead

    backbone = IntermediateLayerGetter(tv.models.resnet18(weights=None), {"layer4": "out"})
    return FCN(backbone, FCNHead(512, LABELS))


DEC = dict(vocab_size=VOCAB, max_position_embeddings=64, num_key_value_heads=1,
           attention_dropout=0.0, **HF_SMALL)
S2S = dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
           encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
           decoder_ffn_dim=64, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
           pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)

ZOO: dict[str, Entry] = {
    # encoders
    "bert": Entry(hf("BertForSequenceClassification", "BertConfig", vocab_size=VOCAB,
                     max_position_embeddings=64, num_labels=LABELS, **HF_SMALL, **HF_NODROP),
                  text_inputs, "encoder"),
    "roberta": Entry(hf("RobertaForSequenceClassification", "RobertaConfig", vocab_size=VOCAB,
                        max_position_embeddings=64, num_labels=LABELS, **HF_SMALL,
                        **HF_NODROP), text_inputs, "encoder"),
    "distilbert": Entry(hf("DistilBertForSequenceClassification", "DistilBertConfig",
                           vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                           max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                           seq_classif_dropout=0.0, num_labels=LABELS),
                        text_inputs, "encoder"),
    "albert": Entry(hf("AlbertForSequenceClassification", "AlbertConfig", vocab_size=VOCAB,
                       embedding_size=16, max_position_embeddings=64, num_labels=LABELS,
                       classifier_dropout_prob=0.0, **HF_SMALL, **HF_NODROP),
                    text_inputs, "encoder"),
    "deberta_v2": Entry(hf("DebertaV2ForSequenceClassification", "DebertaV2Config",
                           vocab_size=VOCAB, max_position_embeddings=64, relative_attention=True,
                           position_buckets=16, pos_att_type=["p2c", "c2p"],
                           pooler_dropout=0.0, num_labels=LABELS, **HF_SMALL, **HF_NODROP),
                        text_inputs, "encoder"),
    "electra": Entry(hf("ElectraForSequenceClassification", "ElectraConfig", vocab_size=VOCAB,
                        embedding_size=32, max_position_embeddings=64, num_labels=LABELS,
                        **HF_SMALL, **HF_NODROP), text_inputs, "encoder"),
    # decoders (default use_cache: the models return a DynamicCache)
    "gpt2": Entry(hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2,
                     n_head=2, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                     attn_pdrop=0.0, bos_token_id=1, eos_token_id=2),
                  text_inputs, "decoder"),
    "llama": Entry(hf("LlamaForCausalLM", "LlamaConfig", **DEC), text_inputs, "decoder"),
    "qwen2": Entry(hf("Qwen2ForCausalLM", "Qwen2Config", **DEC), text_inputs, "decoder"),
    "mistral": Entry(hf("MistralForCausalLM", "MistralConfig", sliding_window=None, **DEC),
                     text_inputs, "decoder"),
    # encoder-decoders
    "t5": Entry(hf("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=32,
                   d_kv=16, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2,
                   dropout_rate=0.0, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0),
                seq2seq_inputs, "encoder-decoder"),
    "bart": Entry(hf("BartForConditionalGeneration", "BartConfig", max_position_embeddings=64,
                     **S2S), seq2seq_inputs, "encoder-decoder"),
    "whisper": Entry(hf("WhisperForConditionalGeneration", "WhisperConfig", num_mel_bins=16,
                        max_source_positions=16, max_target_positions=32, suppress_tokens=[],
                        begin_suppress_tokens=[], **S2S), whisper_inputs, "encoder-decoder"),
    # vision
    "vit": Entry(hf("ViTForImageClassification", "ViTConfig", image_size=IMG, patch_size=8,
                    num_labels=LABELS, **HF_SMALL, **HF_NODROP), image_inputs, "vision"),
    "convnext": Entry(hf("ConvNextForImageClassification", "ConvNextConfig", patch_size=4,
                         num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                         drop_path_rate=0.0, num_labels=LABELS), image_inputs, "vision"),
    "swin": Entry(hf("SwinForImageClassification", "SwinConfig", image_size=IMG, patch_size=4,
                     embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4,
                     drop_path_rate=0.0, num_labels=LABELS, **HF_NODROP),
                  image_inputs, "vision"),
    # torchvision (forward(x)); rows say "not available" while torchvision does not import
    "tv_resnet18": Entry(torchvision_model("resnet18", num_classes=LABELS), BN_IMAGES,
                         "vision (torchvision)"),
    "tv_mobilenet_v3": Entry(torchvision_model("mobilenet_v3_small", num_classes=LABELS),
                             BN_IMAGES, "vision (torchvision)"),
    "tv_efficientnet_b0": Entry(torchvision_model("efficientnet_b0", num_classes=LABELS),
                                BN_IMAGES, "vision (torchvision)"),
    "tv_convnext": Entry(torchvision_model(tv_convnext), images(), "vision (torchvision)"),
    "tv_densenet": Entry(torchvision_model(tv_densenet), images(), "vision (torchvision)"),
    "tv_regnet": Entry(torchvision_model("regnet_y_400mf", num_classes=LABELS), BN_IMAGES,
                       "vision (torchvision)"),
    "tv_shufflenet": Entry(torchvision_model("shufflenet_v2_x0_5", num_classes=LABELS),
                           BN_IMAGES, "vision (torchvision)"),
    "tv_squeezenet": Entry(torchvision_model("squeezenet1_1", num_classes=LABELS), BN_IMAGES,
                           "vision (torchvision)"),
    "tv_mnasnet": Entry(torchvision_model("mnasnet0_5", num_classes=LABELS), BN_IMAGES,
                        "vision (torchvision)"),
    "tv_googlenet": Entry(torchvision_model("googlenet", num_classes=LABELS, aux_logits=False,
                                            init_weights=True), BN_IMAGES,
                          "vision (torchvision)"),
    "tv_vit": Entry(torchvision_model(tv_vit), images(), "vision (torchvision)"),
    "tv_swin": Entry(torchvision_model(tv_swin), images(), "vision (torchvision)"),
    "tv_deeplabv3": Entry(torchvision_model("segmentation.deeplabv3_mobilenet_v3_large",
                                            weights_backbone=None, num_classes=LABELS,
                                            aux_loss=False), BN_IMAGES,
                          "segmentation (torchvision)"),
    "tv_fcn": Entry(torchvision_model(tv_fcn), BN_IMAGES, "segmentation (torchvision)"),
    # timm (forward(x)); "not available" while timm (which needs torchvision) does not import
    "timm_vit_tiny": Entry(timm_model("vit_tiny_patch16_224", img_size=IMG, patch_size=8,
                                      depth=2, num_classes=LABELS), images(), "vision (timm)"),
    "timm_deit_tiny": Entry(timm_model("deit_tiny_distilled_patch16_224", img_size=IMG,
                                       patch_size=8, depth=2, num_classes=LABELS),
                            images(), "vision (timm)"),
    "timm_swin": Entry(timm_model("swin_tiny_patch4_window7_224", img_size=IMG, window_size=4,
                                  embed_dim=16, depths=(1, 1), num_heads=(2, 2),
                                  num_classes=LABELS), images(), "vision (timm)"),
    "timm_mixer": Entry(timm_model(timm_mixer), images(),
                        "vision (timm)"),
    "timm_levit": Entry(timm_model("levit_128s", img_size=64, num_classes=LABELS), BN_IMAGES,
                        "vision (timm)"),
    "timm_convnext": Entry(timm_model("convnext_atto", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32),
                                      num_classes=LABELS), images(), "vision (timm)"),
    "timm_mobilenetv3": Entry(timm_model("mobilenetv3_small_050", num_classes=LABELS),
                              BN_IMAGES, "vision (timm)"),
}
QUICK = ["bert", "gpt2"]


# -- measuring ---------------------------------------------------------------------------


def one_line(exc: BaseException) -> str:
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def logits_of(out: Any) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, dict):  # torchvision segmentation models return {"out": ...}
        return out["logits"] if "logits" in out else out["out"]
    return out[0]


def cosine(a: Any, b: Any) -> float:
    """Cosine similarity in fp64, whatever the magnitudes (torch's ``cosine_similarity``
    clamps norms below 1e-8, which reads tiny logits as orthogonal); nan for a zero vector."""
    a = torch.as_tensor(a).detach().double().flatten()
    b = torch.as_tensor(b).detach().double().flatten()
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        return float("nan")
    scale = a.abs().max() * b.abs().max()
    if scale == 0:
        return float("nan")
    a, b = a / a.abs().max(), b / b.abs().max()
    return float(a @ b / (a.norm() * b.norm()))


def prepare_weights(model: nn.Module, inputs: dict) -> None:
    """Make random weights behave like a trained model's where a fresh init is degenerate:

    - a Linear whose weight is all zero (torchvision ViT's and timm MLP-Mixer's heads) gets
      N(0, 0.02): a zero head makes the logits, and every gradient upstream of it, zero;
    - batch-norm running statistics are set from one train-mode forward (no gradient) of a
      calibration batch of 32 other random images: with the initial mean 0 / variance 1,
      eval-mode activations of deep CNNs shrink layer by layer (MobileNetV3's logits are
      ~1e-10, EfficientNet's ~1e-13); statistics of the test batch itself would make eval
      as ill-conditioned as train mode with 4 images (see docs/zoo.md).
    """
    for m in model.modules():
        if isinstance(m, nn.Linear) and not m.weight.detach().any():
            nn.init.normal_(m.weight, std=0.02)
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
             and m.track_running_stats]
    if not norms:
        return
    momenta = [m.momentum for m in norms]
    training = model.training
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average: after one batch, that batch's statistics
    g = torch.Generator().manual_seed(6)
    calibration = {k: torch.randn(32, *v.shape[1:], generator=g) if v.is_floating_point()
                   else v for k, v in inputs.items()}
    model.train()
    with torch.no_grad():
        model(**calibration)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    model.train(training)


@contextlib.contextmanager
def bf16_rounded(model: nn.Module, inputs: dict) -> Any:
    """The model's parameters rounded to bf16 (still fp32 tensors) for the duration, and the
    inputs with their floating tensors rounded likewise: the fp32 model on bf16-rounded
    values, a measure of how far one rounding alone moves the gradients."""
    params = [(p, p.detach().clone()) for p in model.parameters()]
    with torch.no_grad():
        for p, _ in params:
            p.copy_(p.to(torch.bfloat16).float())
    try:
        yield {k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
               for k, v in inputs.items()}
    finally:
        with torch.no_grad():
            for p, saved in params:
                p.copy_(saved)


def flat_grads(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()]).detach().clone()


def class_rows(logits: torch.Tensor) -> torch.Tensor:
    """Logits as (rows, classes): the last dimension, or the channels of a segmentation map
    (B, C, H, W)."""
    if logits.dim() == 4:
        logits = logits.movedim(1, -1)
    return logits.reshape(-1, logits.shape[-1])


def loss_of(out: Any, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(class_rows(logits_of(out).float()), labels)


def train_grads(model: nn.Module, call: Callable[[], Any], labels: torch.Tensor) -> torch.Tensor:
    """The flat parameter gradients of one train-mode step. The buffers a train-mode forward
    updates (batch-norm running statistics) are put back afterwards, so every step and the
    later eval-mode comparisons see the same state as the fp32 reference."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    model.zero_grad(set_to_none=True)
    try:
        loss_of(call(), labels).backward()
        grads = flat_grads(model)
    finally:
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    return grads


def autocast() -> Any:
    return torch.autocast("cpu", dtype=torch.bfloat16)


def describe_capture(net: nn.Module) -> dict[str, Any]:
    graphs, eager = net.amp_parts()
    parts = [{"path": e.path, "module_type": e.module_type, "reason": e.reason} for e in eager]
    status = "whole graph" if not eager and graphs else ("partly eager" if graphs else "eager")
    return {"status": status, "graphs": len(graphs), "eager": parts}


@contextlib.contextmanager
def quiet() -> Any:
    """Silence prints and warnings; yields the caught warnings."""
    with warnings.catch_warnings(record=True) as caught, \
            contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("always")
        yield caught


def step(row: dict[str, Any], key: str, fn: Callable[[], Any]) -> Any:
    """Run one measurement; on failure record its one-line error under row["errors"]."""
    t0, grad_mode = time.perf_counter(), torch.is_grad_enabled()
    try:
        with quiet() as caught:
            try:
                return fn()
            finally:  # exporter fallbacks (export_onnx warns when TorchScript stood in)
                row["notes"] += sorted({f"{key}: {one_line(w.message)}" for w in caught
                                        if "exporter" in str(w.message)})
    except Exception as exc:  # noqa: BLE001 - the zoo records and goes on
        row["errors"][key] = one_line(exc)
        if os.environ.get("ZOO_TRACEBACK"):
            traceback.print_exc()
        return None
    finally:
        row["seconds"][key] = round(time.perf_counter() - t0, 2)
        if torch.is_grad_enabled() != grad_mode:  # a leak must not spoil the next models
            row["notes"].append(f"{key}: torch's global grad mode was left "
                                f"{'enabled' if not grad_mode else 'disabled'} "
                                "(restored by the zoo)")
            torch.set_grad_enabled(grad_mode)


def onnx_cosines(model: nn.Module, inputs: dict, ref: torch.Tensor, row: dict) -> None:
    import onnx
    import onnxruntime as ort
    from onnxconverter_common import float16

    from ampgraph.onnx import max_ir_version
    from ampgraph.onnx.session import feeds_for

    def run(session: Any) -> float:
        outs = session.run(None, feeds_for(session, inputs))
        match = [o for o in outs if tuple(o.shape) == tuple(ref.shape)]
        if not match:
            raise RuntimeError(f"no ONNX output has the logits' shape {tuple(ref.shape)}")
        return cosine(torch.from_numpy(match[0].astype("float64")), ref)

    def ours() -> float:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "model_fp16.onnx")
            try:
                with warnings.catch_warnings(record=True) as first:
                    warnings.simplefilter("always")
                    ampgraph.export_onnx(model, (), path, amp_level="O2", dtype="fp16",
                                         kwargs=inputs)
                row["notes"] += sorted({f"onnx: {one_line(w.message)}" for w in first
                                        if "exporter" in str(w.message)})
            except Exception as exc:  # its warnings are in the error; try use_cache=False
                if getattr(model.config, "use_cache", None) is not True:
                    raise
                row["notes"].append(f"onnx: export with use_cache=True failed "
                                    f"({one_line(exc)}); exported with use_cache=False")
                model.config.use_cache = False
                try:
                    ampgraph.export_onnx(model, (), path, amp_level="O2", dtype="fp16",
                                         kwargs=inputs)
                finally:
                    model.config.use_cache = True
            return run(ampgraph.onnx_session(path, device="cpu"))

    def converter() -> float:
        cache = getattr(getattr(model, "config", None), "use_cache", None)
        if any("use_cache=False" in n for n in row["notes"]):
            model.config.use_cache = False
        try:
            program = torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False)
        finally:
            if cache is not None:
                model.config.use_cache = cache
        proto = float16.convert_float_to_float16(program.model_proto, keep_io_types=True)
        proto.ir_version = min(proto.ir_version, max_ir_version())
        options = ort.SessionOptions()
        options.log_severity_level = 3
        return run(ort.InferenceSession(proto.SerializeToString(), options,
                                        providers=["CPUExecutionProvider"]))

    del onnx
    model.eval()
    row["onnx_cos"] = step(row, "onnx", ours)
    row["onnx_converter_cos"] = step(row, "onnx_converter", converter)


def timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def speed(model: nn.Module, net: nn.Module, inputs: dict, labels: torch.Tensor,
          repeats: int) -> dict[str, float]:
    def infer(call: Callable[[], Any]) -> Callable[[], Any]:
        def go() -> None:
            with torch.no_grad():
                call()
        return go

    def train(call: Callable[[], Any]) -> Callable[[], Any]:
        def go() -> None:
            loss_of(call(), labels).backward()
            model.zero_grad(set_to_none=True)
        return go

    def amp_call() -> Any:
        with autocast():
            return model(**inputs)

    out = {}
    for mode, wrap, training in (("infer", infer, False), ("train", train, True)):
        model.train(training)
        net.train(training)
        fns = {"autocast": wrap(amp_call), "O2": wrap(lambda: net(**inputs))}
        times: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(2):  # warm-up (captures happened earlier; this settles caches)
            for fn in fns.values():
                fn()
        for _ in range(repeats):
            for k, fn in fns.items():
                times[k].append(timed(fn))
        med = {k: statistics.median(v) for k, v in times.items()}
        out[f"{mode}_ms"] = {k: round(v, 3) for k, v in med.items()}
        out[f"{mode}_ratio"] = round(med["autocast"] / med["O2"], 3)
    model.eval()
    return out


def train_reference(model: nn.Module, inputs: dict, ref: torch.Tensor, row: dict[str, Any]
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fixed random labels of ``ref``'s rows (seed 5) and the fp32 model's train-mode
    gradients of a cross-entropy on them (the step ``fp32_train`` of ``row``: None if it
    failed)."""
    g = torch.Generator().manual_seed(5)
    rows = class_rows(ref)
    labels = torch.randint(0, rows.shape[1], (rows.shape[0],), generator=g)
    model.train()
    return labels, step(row, "fp32_train",
                        lambda: train_grads(model, lambda: model(**inputs), labels))


def bf16_floors(model: nn.Module, inputs: dict, labels: torch.Tensor, ref: torch.Tensor,
                ref_grads: torch.Tensor | None, row: dict[str, Any]) -> None:
    """The fp32 model on its weights and float inputs rounded to bf16 (fp32 arithmetic):
    its eval logits and train-mode gradients against fp32's, into ``row``
    (``bf16_floor_eval_cos``, ``bf16_floor_grad_cos``: None without fp32 gradients). How far
    one bf16 rounding alone moves the result; well below 1, the measurement is
    ill-conditioned for this random model (docs/zoo.md)."""
    def eval_floor() -> float:
        model.eval()
        with torch.no_grad(), bf16_rounded(model, inputs) as rounded:
            return cosine(logits_of(model(**rounded)).float(), ref)

    def grad_floor() -> float:
        model.train()
        with bf16_rounded(model, inputs) as rounded:
            return cosine(train_grads(model, lambda: model(**rounded), labels), ref_grads)

    row["bf16_floor_eval_cos"] = step(row, "bf16_floor_eval", eval_floor)
    row["bf16_floor_grad_cos"] = step(row, "bf16_floor_train", grad_floor) \
        if ref_grads is not None else None


def autocast_cosines(model: nn.Module, inputs: dict, labels: torch.Tensor, ref: torch.Tensor,
                     ref_grads: torch.Tensor | None, row: dict[str, Any]) -> None:
    """torch.autocast(bf16)'s eval logits and train-mode gradients against fp32's, into
    ``row`` (``autocast_eval_cos``, ``autocast_grad_cos``: None without fp32 gradients)."""
    def ac_eval() -> float:
        model.eval()
        with torch.no_grad(), autocast():
            return cosine(logits_of(model(**inputs)).float(), ref)

    def ac_train() -> float:
        model.train()

        def call() -> Any:
            with autocast():
                return model(**inputs)
        return cosine(train_grads(model, call, labels), ref_grads)

    row["autocast_eval_cos"] = step(row, "autocast_eval", ac_eval)
    row["autocast_grad_cos"] = step(row, "autocast_train", ac_train) if ref_grads is not None \
        else None


def run_model(name: str, entry: Entry, skip_onnx: bool, skip_speed: bool,
              repeats: int) -> dict[str, Any]:
    row: dict[str, Any] = {"model": name, "family": entry.family, "capture": None,
                           "errors": {}, "notes": [], "seconds": {}}
    try:
        with quiet():
            model = entry.builder()
    except NotAvailable as exc:
        row["capture"] = {"status": "not available", "eager": [], "graphs": 0}
        row["errors"]["build"] = str(exc)
        return row
    except Exception as exc:  # noqa: BLE001
        row["capture"] = {"status": "failed", "eager": [], "graphs": 0}
        row["errors"]["build"] = one_line(exc)
        return row
    inputs = entry.inputs()
    row["params"] = sum(p.numel() for p in model.parameters())
    prepare_weights(model, inputs)

    # fp32 references (eval logits, train gradients) and the fixed random labels
    model.eval()
    with torch.no_grad():
        ref = logits_of(model(**inputs)).float()
    labels, ref_grads = train_reference(model, inputs, ref, row)
    bf16_floors(model, inputs, labels, ref, ref_grads, row)
    autocast_cosines(model, inputs, labels, ref, ref_grads, row)

    # ampgraph O2 bf16
    net = step(row, "compile", lambda: ampgraph.compile(model, amp_level="O2", dtype="bf16"))

    def o2_eval() -> float:
        model.eval()
        net.eval()
        with torch.no_grad():
            out = logits_of(net(**inputs)).float()
        row["capture"] = describe_capture(net)
        return cosine(out, ref)

    def o2_train() -> float:
        model.train()
        net.train()
        grads = train_grads(model, lambda: net(**inputs), labels)
        capture = describe_capture(net)
        if row["capture"] is None or ([(e["path"], e["reason"]) for e in capture["eager"]]
                                      != [(e["path"], e["reason"])
                                          for e in row["capture"]["eager"]]):
            row["capture_train"] = capture
            row["capture"] = row["capture"] or capture
        return cosine(grads, ref_grads)

    row["o2_eval_cos"] = step(row, "o2_eval", o2_eval) if net is not None else None
    row["o2_grad_cos"] = step(row, "o2_train", o2_train) \
        if net is not None and ref_grads is not None else None
    if row["capture"] is None:
        err = row["errors"].get("o2_eval") or row["errors"].get("compile") or "not run"
        row["capture"] = {"status": "failed", "eager": [], "graphs": 0, "error": err}
    model.eval()

    if not skip_onnx:
        onnx_cosines(model, inputs, ref, row)
    if not skip_speed and net is not None and row.get("o2_eval_cos") is not None:
        row["speed"] = step(row, "speed", lambda: speed(model, net, inputs, labels, repeats))
    return row


# -- output ------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if v != v else f"{v:.5f}"
    return str(v)


def capture_cell(row: dict) -> str:
    cap = row["capture"]
    text = cap["status"]
    if cap.get("eager"):
        text += f" ({len(cap['eager'])} eager)"
    if "capture_train" in row:
        train = row["capture_train"]
        text += f"; train: {train['status']}"
        if train.get("eager"):
            text += f" ({len(train['eager'])} eager)"
    return text


def table(rows: list[dict]) -> str:
    head = ["model", "family", "capture", "O2 eval cos", "autocast eval cos", "O2 grad cos",
            "autocast grad cos", "bf16 floor eval / grad", "ONNX O2 fp16 cos",
            "onnxconverter fp16 cos", "infer x (noisy)", "train x (noisy)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sp = r.get("speed") or {}
        cells = [r["model"], r["family"], capture_cell(r), fmt(r.get("o2_eval_cos")),
                 fmt(r.get("autocast_eval_cos")), fmt(r.get("o2_grad_cos")),
                 fmt(r.get("autocast_grad_cos")),
                 f'{fmt(r.get("bf16_floor_eval_cos"))} / {fmt(r.get("bf16_floor_grad_cos"))}',
                 fmt(r.get("onnx_cos")),
                 fmt(r.get("onnx_converter_cos")), fmt(sp.get("infer_ratio")),
                 fmt(sp.get("train_ratio"))]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def criteria(row: dict) -> dict[str, bool | None]:
    """Issue 14's done-when checks for one row (None: not measured)."""
    def num(key: str) -> float | None:
        v = row.get(key)
        return v if isinstance(v, float) and v == v else None

    train = row.get("capture_train") or {}
    whole = row["capture"]["status"] == "whole graph" and train.get("status") in (
        None, "whole graph")
    o2, ac = num("o2_eval_cos"), num("autocast_eval_cos")
    o2g, acg = num("o2_grad_cos"), num("autocast_grad_cos")
    onnx = num("onnx_cos")
    return {
        "whole graph": whole,
        "eval": None if o2 is None or ac is None else (o2 >= 0.99 and o2 >= ac - 0.005),
        "grad": None if o2g is None or acg is None else o2g >= acg - 0.01,
        "onnx": None if "onnx_cos" not in row else (onnx is not None and onnx >= 0.99),
    }


def summary(rows: list[dict]) -> str:
    ran = [r for r in rows if r["capture"]["status"] != "not available"]
    checks = [criteria(r) for r in ran]
    parts = [f"{len(ran)} of {len(rows)} models available"]
    for key, what in (("whole graph", "captured whole (eval and train)"),
                      ("eval", "O2 eval cos >= 0.99 and >= autocast's - 0.005"),
                      ("grad", "O2 grad cos >= autocast's - 0.01"),
                      ("onnx", "ONNX O2 fp16 cos >= 0.99")):
        measured = [c[key] for c in checks if c[key] is not None]
        failed = [r["model"] for r, c in zip(ran, checks) if c[key] is False]
        parts.append(f"{what}: {sum(measured)}/{len(measured)}"
                     + (f" (not: {', '.join(failed)})" if failed else ""))
    return "; ".join(parts)


def details(rows: list[dict]) -> str:
    out = []
    for r in rows:
        for e in r["capture"].get("eager", []):
            out.append(f"- {r['model']}: eager `{e['path']}` ({e['module_type']}): {e['reason']}")
        seen = {(e["path"], e["reason"]) for e in r["capture"].get("eager", [])}
        for e in (r.get("capture_train") or {}).get("eager", []):
            if (e["path"], e["reason"]) not in seen:
                out.append(f"- {r['model']} (train mode): eager `{e['path']}` "
                           f"({e['module_type']}): {e['reason']}")
        for step_name, err in r["errors"].items():
            out.append(f"- {r['model']} {step_name}: {err}")
        for note in r["notes"]:
            out.append(f"- {r['model']} note: {note}")
    return "\n".join(out)


def chosen(parser: argparse.ArgumentParser, models: str | None, known: dict,
           default: list[str] | None = None) -> list[str]:
    """The names of a ``--models a,b`` argument (``default``, else all of ``known``, when
    not given); an unknown name is the parser's error."""
    names = models.split(",") if models else (default or list(known))
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {', '.join(known)}")
    return names


def main(argv: list[str] | None = None) -> int:
    for logger in ("torch.onnx", "torch.export", "onnxscript", "transformers"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help="comma-separated names (default: all); "
                        f"known: {','.join(ZOO)}")
    parser.add_argument("--quick", action="store_true",
                        help=f"the small fast subset ({','.join(QUICK)}) unless --models")
    parser.add_argument("--skip-onnx", action="store_true")
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per mode")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    names = chosen(parser, args.models, ZOO, QUICK if args.quick else None)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = run_model(name, ZOO[name], args.skip_onnx, args.skip_speed, args.repeats)
        row["total_seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(f"[{name}] {capture_cell(row)} in {row['total_seconds']} s", file=sys.stderr,
              flush=True)
    print(table(rows))
    print("\n" + summary(rows))
    more = details(rows)
    if more:
        print("\n" + more)
    print("\nspeed: autocast time / O2 time (>1: O2 faster), median of "
          f"{args.repeats} interleaved repeats on tiny models: noisy")
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "command": " ".join(["python", "benchmarks/zoo.py", *(argv or sys.argv[1:])]),
                "threads": torch.get_num_threads()}
        for row in rows:
            row["criteria"] = criteria(row)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": summary(rows), "models": rows}, f, indent=2,
                      default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
