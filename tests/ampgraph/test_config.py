"""ampgraph.config: AmpConfig and its one resolution, ResolvedConfig (level, dtype, runtime
for a device, or for an ONNX graph), and that compile, build_train_step and the ONNX entry
points all go through it, once."""

from __future__ import annotations

import dataclasses
import re
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import ampgraph
from ampgraph import config as config_module
from ampgraph.config import AmpConfig, ResolvedConfig, parse_dtype, parse_level

CPU = torch.device("cpu")
CUDA = torch.device("cuda", 0)
DTYPE_CHOICES = r"choose one of auto, bf16, fp16, torch.bfloat16, torch.float16"


@pytest.fixture
def fast_fp16(monkeypatch):
    """Set whether this CPU has fp16 arithmetic."""
    def set_(value: bool) -> None:
        monkeypatch.setattr(config_module, "cpu_has_fast_fp16", lambda: value)
    return set_


@pytest.fixture
def capability(monkeypatch):
    """Pretend the CUDA device has this compute capability (no GPU needed: only the
    capability is asked); records the devices asked about."""
    asked: list[torch.device] = []

    def set_(major: int, minor: int = 0) -> list[torch.device]:
        def get(device=None):
            asked.append(device)
            return major, minor
        monkeypatch.setattr(torch.cuda, "get_device_capability", get)
        return asked
    return set_


@pytest.fixture
def resolve_calls(monkeypatch):
    """Every (config, device) AmpConfig.resolve is called with, the real resolution kept."""
    calls: list[tuple[AmpConfig, torch.device | None]] = []
    real = AmpConfig.resolve

    def counting(self, device):
        calls.append((self, device))
        return real(self, device)

    monkeypatch.setattr(AmpConfig, "resolve", counting)
    return calls


def resolve(device=CPU, **kwargs) -> ResolvedConfig:
    return AmpConfig.create(**kwargs).resolve(device)


# -- dtype --------------------------------------------------------------------------------


@pytest.mark.parametrize("has_fp16", [False, True])
def test_auto_is_bf16_on_a_cpu_with_or_without_fp16_arithmetic(fast_fp16, has_fp16):
    fast_fp16(has_fp16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "auto" never picks a dtype that warns
        assert resolve(dtype="auto").dtype == torch.bfloat16
        assert resolve(dtype="AUTO").dtype == torch.bfloat16


@pytest.mark.parametrize("major, expected", [(6, torch.float16), (7, torch.float16),
                                             (8, torch.bfloat16), (9, torch.bfloat16)])
def test_auto_on_cuda_is_bf16_from_sm80_and_fp16_before(capability, major, expected):
    asked = capability(major)
    assert resolve(CUDA, dtype="auto").dtype == expected
    assert asked == [CUDA]  # the capability of the device resolved for


def test_fp16_on_a_cpu_warns_only_without_fp16_arithmetic(fast_fp16):
    fast_fp16(False)
    with pytest.warns(RuntimeWarning, match="hundreds of times slower than fp32. Use "
                                            "dtype='bf16'"):
        assert resolve(dtype="fp16").dtype == torch.float16
    fast_fp16(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(dtype="fp16").dtype == torch.float16


def test_fp16_on_cuda_does_not_ask_about_the_cpu(fast_fp16, capability):
    fast_fp16(False)
    capability(7, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve(CUDA, dtype="fp16").dtype == torch.float16


@pytest.mark.parametrize("name", ["bf16", "bfloat16", "BF16", "torch.bfloat16",
                                  torch.bfloat16])
def test_bf16_names_and_torch_dtype(name):
    assert parse_dtype(name) == torch.bfloat16
    assert resolve(dtype=name).dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["fp16", "float16", "half", "FP16", "torch.float16",
                                  torch.float16])
def test_fp16_names_and_torch_dtype(fast_fp16, name):
    fast_fp16(True)
    assert parse_dtype(name) == torch.float16
    assert resolve(dtype=name).dtype == torch.float16


def test_o0_computes_in_fp32_without_asking_the_device(monkeypatch, fast_fp16):
    fast_fp16(False)

    def no_gpu(device=None):
        raise AssertionError("O0 resolved the device's dtype")

    monkeypatch.setattr(torch.cuda, "get_device_capability", no_gpu)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fp16-on-CPU warning: nothing runs in fp16
        assert resolve(amp_level="O0", dtype="fp16").dtype == torch.float32
        assert resolve(CUDA, amp_level="O0").dtype == torch.float32
    with pytest.raises(ValueError, match=rf"unknown dtype 'fp8': {DTYPE_CHOICES}"):
        AmpConfig(amp_level="O0", dtype="fp8").resolve(CPU)  # still checked at O0


@pytest.mark.parametrize("dtype, message", [
    ("fp8", rf"unknown dtype 'fp8': {DTYPE_CHOICES}"),
    ("float32", rf"unknown dtype 'float32' \(not a 16-bit float\): {DTYPE_CHOICES}"),
    (torch.float32, rf"unknown dtype torch.float32 \(not a 16-bit float\): {DTYPE_CHOICES}"),
    (torch.int8, rf"unknown dtype torch.int8 \(not a 16-bit float\): {DTYPE_CHOICES}"),
    (16, rf"unknown dtype 16 \(of type int\): {DTYPE_CHOICES}"),
    (None, rf"unknown dtype None \(of type NoneType\): {DTYPE_CHOICES}"),
])
def test_bad_dtypes_name_the_choices(dtype, message):
    with pytest.raises(ValueError, match=message):
        AmpConfig.create(dtype=dtype)
    with pytest.raises(ValueError, match=message):  # unvalidated: the resolution checks
        AmpConfig(dtype=dtype).resolve(CPU)


# -- level --------------------------------------------------------------------------------


def test_levels_are_case_insensitive():
    assert parse_level("o2") == "O2"
    resolved = AmpConfig(amp_level="o1").resolve(CPU)
    assert resolved.level == "O1" and resolved.config.amp_level == "O1"
    assert resolve(amp_level="o3").level == "O3"


@pytest.mark.parametrize("level", ["O4", "", "fast", None, 2])
def test_bad_levels_name_the_choices(level):
    message = r"unknown amp_level .*: choose one of O0, O1, O2, O3"
    with pytest.raises(ValueError, match=message):
        AmpConfig.create(amp_level=level)
    with pytest.raises(ValueError, match=message):
        AmpConfig(amp_level=level).resolve(CPU)
    with pytest.raises(ValueError, match=message):
        AmpConfig(amp_level=level, dtype="fp16").resolve(None)


# -- runtime, backend, device -------------------------------------------------------------


def test_runtime_is_the_devices_own(capability):
    capability(8)
    assert resolve(CPU).runtime == "cpu"
    assert resolve(CUDA).runtime == "cuda"
    assert resolve(torch.device("meta")).runtime == "aten"  # no runtime of its own


@pytest.mark.parametrize("runtime", ["aten", "cpu", "cuda"])
def test_a_named_runtime_wins_on_any_device(runtime):
    resolved = resolve(CPU, runtime=runtime)
    assert resolved.runtime == runtime
    assert resolved.runtime_on(torch.device("meta")) == runtime


def test_runtime_on_follows_a_model_that_moved_and_keeps_the_dtype():
    resolved = resolve(CPU, dtype="auto")
    assert resolved.runtime_on(CUDA) == "cuda"
    assert resolved.runtime_on(torch.device("meta")) == "aten"
    assert resolved.dtype == torch.bfloat16 and resolved.device == CPU


def test_bad_runtime_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown runtime 'tpu': choose one of aten, cpu, "
                                         r"cuda, or None for the model's device's"):
        AmpConfig.create(runtime="tpu")


def test_resolved_holds_level_dtype_backend_device_runtime_and_is_frozen():
    resolved = resolve(CPU, amp_level="o1", dtype="bf16", backend="inductor")
    assert (resolved.level, resolved.dtype, resolved.backend, resolved.device,
            resolved.runtime) == ("O1", torch.bfloat16, "inductor", CPU, "cpu")
    assert resolved.config == AmpConfig.create(amp_level="O1", dtype="bf16", backend="inductor")
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolved.dtype = torch.float16
    assert resolved == resolve(CPU, amp_level="O1", dtype="bf16", backend="inductor")
    assert resolved.policy() == resolved.config.policy(torch.bfloat16)


def test_compile_options_are_validated_kept_and_round_trip_through_to_dict():
    config = AmpConfig.create(backend="inductor", compile_options={"mode": "max-autotune"})
    assert config.compile_options == {"mode": "max-autotune"}
    assert config.resolve(CPU).compile_options == {"mode": "max-autotune"}
    assert AmpConfig.create().compile_options == {}  # the default: torch.compile's own
    assert AmpConfig.create(backend="inductor", compile_options=None).compile_options == {}
    doc = config.to_dict()
    assert doc["compile_options"] == {"mode": "max-autotune"} and doc["backend"] == "inductor"
    assert AmpConfig.create(**doc) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.compile_options = {}


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(compile_options={"mode": "max-autotune"}), ValueError,
     r"but backend is None \(the graph runs eagerly\): pass backend='inductor'"),
    (dict(backend="inductor", compile_options={"mode": "fastest"}), ValueError,
     r"compile_options\['mode'\] = 'fastest': choose one of .*max-autotune"),
    (dict(backend="inductor", compile_options={"fullgraph": True, "speed": 1}), ValueError,
     r"unknown key\(s\) speed: choose from mode, options, dynamic, fullgraph"),
    (dict(backend="inductor", compile_options=["max-autotune"]), TypeError,
     r"compile_options must be a dict .* got list"),
])
def test_bad_compile_options_say_what_and_how_to_fix(kwargs, error, message):
    with pytest.raises(error, match=message):
        AmpConfig.create(**kwargs)


def test_contradictory_override_is_refused_by_the_resolved_policy():
    resolved = resolve(CPU, dtype="bf16", module_overrides={"head": "fp16"})
    with pytest.raises(ValueError, match=r"module_overrides\['head'\] = 'fp16' but the "
                                         r"compile dtype is bf16"):
        resolved.policy()


# -- ONNX: no device ----------------------------------------------------------------------


@pytest.mark.parametrize("name, expected", [("fp16", torch.float16), ("float16", torch.float16),
                                            ("bf16", torch.bfloat16),
                                            ("bfloat16", torch.bfloat16)])
def test_onnx_takes_named_dtypes_and_has_no_device_or_runtime(fast_fp16, name, expected):
    fast_fp16(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no CPU to warn about
        resolved = AmpConfig(amp_level="o2", dtype=name).resolve(None)
    assert (resolved.level, resolved.dtype, resolved.device, resolved.runtime) == (
        "O2", expected, None, None)
    assert AmpConfig(amp_level="O0", dtype=name).resolve(None).dtype == torch.float32


@pytest.mark.parametrize("dtype", ["auto", "fp8", "float32", torch.float32, 16])
def test_onnx_refuses_auto_and_unknown_dtypes(dtype):
    with pytest.raises(ValueError, match=rf"unknown dtype {re.escape(repr(dtype))} for ONNX: "
                                         r"choose 'fp16' or 'bf16'"):
        AmpConfig(dtype=dtype).resolve(None)


# -- everything goes through the one resolution, once -------------------------------------


def test_compile_resolves_once_on_the_models_device(resolve_calls):
    model = nn.Linear(4, 4)
    net = ampgraph.compile(model, "o2", "bf16")
    assert [(c.amp_level, c.dtype, d) for c, d in resolve_calls] == [("O2", "bf16", CPU)]
    resolved = net.amp_resolved
    assert isinstance(resolved, ResolvedConfig)
    assert net.amp_config is resolved.config and net.amp_dtype is resolved.dtype
    assert ampgraph.compile(net, "O2", torch.bfloat16) is net  # resolved again, same result
    assert len(resolve_calls) == 2


def test_compile_uses_what_the_resolver_returns(monkeypatch):
    real = AmpConfig.resolve

    def fp16_everywhere(self, device):
        return dataclasses.replace(real(self, device), dtype=torch.float16)

    monkeypatch.setattr(AmpConfig, "resolve", fp16_everywhere)
    net = ampgraph.compile(nn.Linear(4, 4), "O2", "bf16")
    assert net.amp_dtype == torch.float16
    x = torch.randn(2, 4)
    assert net(x).dtype == torch.float32  # keep_io_types
    report = ampgraph.explain(net, x)
    assert report.dtype == "fp16"  # the graph computes in the resolver's dtype
    assert [row["precision"] for row in report.nodes if row["op"] == "aten.linear"] == ["fp16"]


def test_build_train_step_resolves_once(resolve_calls):
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = ampgraph.build_train_step(model, F.mse_loss, opt, "O2", "bf16")
    assert [(c.amp_level, c.dtype, d) for c, d in resolve_calls] == [("O2", "bf16", CPU)]
    assert step.module.amp_resolved.dtype == torch.bfloat16


def test_build_train_step_on_a_compiled_model_resolves_only_a_dtype_it_is_given(resolve_calls):
    net = ampgraph.compile(nn.Linear(4, 2), "O2", "bf16")
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    resolve_calls.clear()
    ampgraph.build_train_step(net, F.mse_loss, opt)
    assert resolve_calls == []  # the compiled module's resolution is the one used
    ampgraph.build_train_step(net, F.mse_loss, opt, dtype="bfloat16")
    assert [(c.dtype, d) for c, d in resolve_calls] == [("bfloat16", CPU)]
    with pytest.raises(ValueError, match="compiled with dtype bf16 but build_train_step got "
                                         "dtype='fp16'"):
        ampgraph.build_train_step(net, F.mse_loss, opt, dtype="fp16")


def matmul_model() -> object:
    w = numpy_helper.from_array(np.eye(4, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, (2, 4))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, (2, 4))], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_convert_onnx_resolves_once_without_a_device(resolve_calls):
    from ampgraph.onnx import convert_onnx

    out = convert_onnx(matmul_model(), "o2", "float16")
    assert [(c.amp_level, c.dtype, d) for c, d in resolve_calls] == [("o2", "float16", None)]
    stamp = {p.key: p.value for p in out.metadata_props}
    assert stamp["ampgraph.amp_level"] == "O2" and stamp["ampgraph.dtype"] == "fp16"
    assert convert_onnx(out, "O2", "fp16") is not None  # spelled differently: the same


def test_export_onnx_resolves_once_before_exporting(resolve_calls, monkeypatch, tmp_path):
    from ampgraph.onnx import export_onnx

    path = tmp_path / "linear.onnx"
    export_onnx(nn.Linear(4, 4), (torch.randn(2, 4),), path, "O2", "bf16")
    assert [(c.dtype, d) for c, d in resolve_calls] == [("bf16", None)]

    def no_export(*args, **kwargs):
        raise AssertionError("exported before the dtype was checked")

    monkeypatch.setattr(torch.onnx, "export", no_export)
    with pytest.raises(ValueError, match="unknown dtype 'auto' for ONNX"):
        export_onnx(nn.Linear(4, 4), (torch.randn(2, 4),), tmp_path / "x.onnx", "O2", "auto")
