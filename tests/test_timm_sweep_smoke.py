"""benchmarks/timm_sweep.py's selection and verdicts, without timm: the sub-architectures a
family's names fall into, which of them the sweep takes and in what order, and how a row of
it is judged (hf_sweep.py's criteria)."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "benchmarks"))
import hf_sweep  # noqa: E402
import timm_sweep  # noqa: E402


def test_stem_is_the_first_word_less_its_size_digits():
    assert timm_sweep.stem("seresnext26t_32x4d") == "seresnext"
    assert timm_sweep.stem("resnet18") == "resnet"
    assert timm_sweep.stem("vit_tiny_patch16_224") == "vit"
    assert timm_sweep.stem("convnextv2_atto") == "convnextv"
    assert timm_sweep.stem("dla46x_c") == "dla"
    assert timm_sweep.stem("test_vit") == "test"


def test_variant_is_the_name_less_its_size_words():
    assert timm_sweep.variant("resnet50d") == "resnet#d"
    assert timm_sweep.variant("vit_base_patch16_siglip_224") == "vit_siglip"
    assert timm_sweep.variant("vit_tiny_patch16_224") == "vit"
    assert timm_sweep.variant("mobilenetv4_conv_small_035") == "mobilenetv#_conv"
    assert timm_sweep.variant("convnext_atto_ols") == "convnext_ols"


def test_select_takes_every_familys_smallest_first_then_the_other_stems():
    families = {
        "resnet": ["resnet18", "resnet10t", "seresnet18", "seresnet50", "wide_resnet101_2"],
        "vision_transformer": ["vit_tiny_patch16_224", "vit_base_patch16_224", "test_vit"],
        "regnet": ["regnetx_002", "regnety_002"],
    }
    params = {"resnet18": 11_000_000, "resnet10t": 5_000_000, "seresnet18": 11_200_000,
              "seresnet50": 28_000_000, "wide_resnet101_2": 126_000_000,
              "vit_tiny_patch16_224": 5_500_000, "vit_base_patch16_224": 86_000_000,
              "test_vit": 300_000, "regnetx_002": None, "regnety_002": None}
    todo = timm_sweep.select(families, params, max_params=60_000_000,
                             variant_params=30_000_000, variants=4)
    assert todo == [
        ("test_vit", "vision_transformer", "-"), ("resnet10t", "resnet", "-"),
        ("regnetx_002", "regnet", "-"),  # unknown sizes after known ones
        ("vit_tiny_patch16_224", "vision_transformer", "-"),
        ("resnet18", "resnet", "-"),  # a variant of the resnet stem: resnet# (resnet10t: #t)
        ("seresnet18", "resnet", "-"),
    ]  # wide_resnet (126M) past max_params; regnety unknown: only a family's first


def row(**kw) -> dict:
    base = {"arch": "m", "kind": "f", "class": "M", "status": "counted", "errors": {},
            "notes": [], "capture": {"status": "whole graph", "eager": []},
            "capture_train": {"status": "whole graph", "eager": []}, "o2_eval_cos": 0.9999,
            "autocast_eval_cos": 0.9999, "o2_grad_cos": 0.999, "autocast_grad_cos": 0.999,
            "o2_grads_finite": True, "grad_mode_kept": True, "compile_s": 5.0,
            "bf16_floor_eval_cos": 1.0, "bf16_floor_grad_cos": 0.999}
    return {**base, **kw}


def test_a_timm_row_is_judged_by_the_transformers_sweeps_criteria():
    good, slow = row(), row(compile_s=31.0)
    eager = row(capture_train={"status": "partly eager",
                               "eager": [{"path": "head", "module_type": "X", "reason": "r"}]})
    ill = row(o2_grad_cos=0.9, autocast_grad_cos=0.98, bf16_floor_grad_cos=0.95)
    for r in (good, slow, eager, ill):
        hf_sweep.judge(r)
    assert good["passed"] and not slow["passed"] and not eager["passed"]
    assert hf_sweep.failure_reasons(slow) == ["compile + first call > 30 s"]
    assert hf_sweep.failure_reasons(eager) == ["not captured whole: r"]
    assert ill["status"] == "apart" and "ill-conditioned" in ill["reason"]
    low = [row(o2_eval_cos=o2, autocast_eval_cos=ac) for o2, ac in
           ((0.97, 0.98), (0.985, 0.986), (0.987, 0.991))]
    for r in low:
        hf_sweep.judge(r)
    assert [hf_sweep.failure_reasons(r) for r in low] == [
        ["O2 eval cos < autocast's - 0.005"], ["O2 eval cos < 0.99, as autocast's"],
        ["O2 eval cos < 0.99, autocast's >= 0.99"]]
    text = hf_sweep.summary([good, slow, ill])
    assert text.startswith("3 architectures: 2 counted, 1 listed apart; "
                           "passed every criterion: 1/2 (50.0%)")
