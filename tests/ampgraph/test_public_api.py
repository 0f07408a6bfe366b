"""The public surface is small, explicit and pinned."""

from __future__ import annotations

import ampgraph

EXPECTED = {
    "AdaptiveLossScaleManager", "AmpConfig", "AmpModule", "CheckpointWarning",
    "DynamicLossScaleManager",
    "FixedLossScaleManager", "GraphCapture",
    "LossScaleManager", "NumericsMonitor", "NumericsWarning", "OnnxModelError",
    "PrecisionReport", "StepOutput", "TrainStep", "ValidationReport", "build_train_step",
    "compile", "convert_onnx", "explain", "export_onnx", "onnx_session", "validate_onnx",
    "shard", "save_checkpoint", "load_checkpoint", "compress_ddp_gradients", "FP8Recipe",
}


def test_all_is_pinned():
    assert set(ampgraph.__all__) == EXPECTED
    assert len(ampgraph.__all__) == len(EXPECTED)


def test_every_exported_name_resolves():
    for name in ampgraph.__all__:
        assert getattr(ampgraph, name) is not None, name


def test_compile_signature_matches_the_issue():
    import inspect

    sig = inspect.signature(ampgraph.compile)
    assert list(sig.parameters)[:3] == ["model", "amp_level", "dtype"]
    assert sig.parameters["amp_level"].default == "O2"
    assert sig.parameters["dtype"].default == "auto"
    for name in ("keep_batchnorm_fp32", "custom_allow", "custom_deny", "module_overrides",
                 "keep_io_types"):
        assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY
