"""fp16 overflow found by a calibration run: a VAE-decoder-like block whose activations
exceed fp16's range turns to inf/NaN under ``.half()``, autocast and plain O2 fp16; after
``AmpModule.calibrate`` the ops that overflowed stay fp32 and the output matches fp32."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampgraph
from passes.fx.calibration import observe_magnitudes, overflowing


class Decoder(nn.Module):
    """conv_in, a mid-block (GroupNorm, SiLU, conv, twice) with a residual, nearest
    upsampling + conv, conv_out. ``conv2``'s weights are scaled (as SDXL's VAE's are) so
    its output and the residual sum reach ~3e5; ``norm_out`` brings them back to O(1)."""

    def __init__(self, c: int = 8, scale: float = 2e5):
        super().__init__()
        self.conv_in = nn.Conv2d(4, c, 3, padding=1)
        self.norm1, self.conv1 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm2, self.conv2 = nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1)
        self.norm_out = nn.GroupNorm(4, c)
        self.up = nn.Conv2d(c, c, 3, padding=1)
        self.conv_out = nn.Conv2d(c, 3, 3, padding=1)
        with torch.no_grad():
            self.conv2.weight.mul_(scale)
            self.conv2.bias.mul_(scale)

    def forward(self, z):
        h = self.conv_in(z)
        h = h + self.conv2(F.silu(self.norm2(self.conv1(F.silu(self.norm1(h))))))
        h = F.interpolate(F.silu(self.norm_out(h)), scale_factor=2.0, mode="nearest")
        return self.conv_out(self.up(h))


def _decoder():
    torch.manual_seed(0)
    return Decoder().eval(), torch.randn(1, 4, 16, 16)


def _rel(out, ref):
    return float((out.float() - ref).norm() / ref.norm())


@torch.no_grad()
def test_the_decoder_overflows_under_half_and_autocast():
    model, z = _decoder()
    ref = model(z)
    assert torch.isfinite(ref).all() and ref.abs().max() < 100
    assert not torch.isfinite(copy.deepcopy(model).half()(z.half())).all()
    with torch.autocast("cpu", torch.float16):  # CPU autocast runs convs in fp16
        out = model(z)
    assert out.dtype == torch.float16 and not torch.isfinite(out).all()


@torch.no_grad()
def test_o2_fp16_overflows_without_calibration():
    model, z = _decoder()
    assert not torch.isfinite(ampgraph.compile(model, "O2", "fp16")(z)).all()


@torch.no_grad()
def test_calibrate_keeps_the_overflowing_ops_fp32():
    model, z = _decoder()
    ref = model(z)
    net = ampgraph.compile(model, "O2", "fp16")
    net(z)
    found = net.calibrate(z)
    assert set(found) == {"conv2:aten.conv2d#0", ":aten.add.Tensor#0",
                          "norm_out:aten.group_norm#0"}
    out = net(z)
    assert torch.isfinite(out).all() and _rel(out, ref) < 1e-2
    rows = {r["name"]: r for r in ampgraph.explain(net).nodes}
    for name in ("conv2d_2", "add", "group_norm_2"):
        assert rows[name]["precision"] == "fp32"
        assert rows[name]["reason"].startswith("calibration: max |")
        assert "exceeds fp16's range (65504) / 4: kept fp32" in rows[name]["reason"]
    assert "max |output| = 2.9" in rows["conv2d_2"]["reason"]
    for name in ("conv2d", "conv2d_1", "conv2d_3", "conv2d_4"):  # the others stay fp16
        assert rows[name]["precision"] == "fp16", rows[name]


@torch.no_grad()
def test_calibration_holds_across_recapture_for_other_shapes():
    model, z = _decoder()
    net = ampgraph.compile(model, "O2", "fp16")
    net.calibrate(z)
    z2 = torch.randn(2, 4, 8, 8)  # a new capture: other batch and latent size
    out = net(z2)
    assert torch.isfinite(out).all() and _rel(out, model(z2)) < 1e-2


@torch.no_grad()
def test_calibrate_finds_nothing_in_range_or_for_bf16():
    torch.manual_seed(0)
    model, z = Decoder(scale=1.0).eval(), torch.randn(1, 4, 8, 8)
    assert ampgraph.compile(model, "O2", "fp16").calibrate(z) == {}
    big, z = _decoder()
    assert ampgraph.compile(big, "O2", "bf16").calibrate(z) == {}


@pytest.mark.parametrize("low, marked", [(torch.float16, True), (torch.bfloat16, False),
                                         (torch.float32, False)])
def test_overflowing_threshold(low, marked):
    mags = {"a:aten.mm#0": (65504 / 4 + 1, 1.0), "b:aten.mm#0": (65504 / 4 - 1, 1.0),
            "c:aten.add.Tensor#0": (1.0, 3e5)}
    found = overflowing(mags, low)
    assert set(found) == ({"a:aten.mm#0", "c:aten.add.Tensor#0"} if marked else set())
    if marked:
        assert "max |input| = 3e+05" in found["c:aten.add.Tensor#0"]
    assert set(overflowing({"n:aten.mm#0": (float("nan"), 0.0)}, torch.float16)) == \
        {"n:aten.mm#0"}


def test_observe_magnitudes_keys_ops_by_module_and_occurrence():
    model, z = _decoder()
    gm = torch.export.export(model, (z,)).module()
    # an export of the bare model: its placeholders take (z,) positionally
    seen = observe_magnitudes(gm, (z,), {})
    assert seen["conv2:aten.conv2d#0"][0] > 2e5
    assert seen["conv1:aten.conv2d#0"][0] < 10
    assert seen[":aten.silu#1"][1] < 10  # the second silu of the root's own code
