"""diffusers' models through O2 bf16, representatives of ``benchmarks/diffusers_models.py``
(docs/zoo.md "diffusers"): a conditional U-Net in eval and train mode and in a denoising
loop, Flux's gradients (its sinusoidal time embedder's among them), the VAE. Tiny random
configs; the measurements are the zoo's own (``benchmarks/zoo.py``)."""

from __future__ import annotations

import pytest
import torch

import ampgraph
from benchmarks import diffusers_models as dm

pytest.importorskip("diffusers")
zoo = dm.zoo


def tiny_unet() -> torch.nn.Module:
    """A UNet2DConditionModel of one cross-attention block (time embedding, mid block)."""
    from diffusers import UNet2DConditionModel
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(16,), norm_num_groups=8, cross_attention_dim=16,
        attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D",),
        up_block_types=("CrossAttnUpBlock2D",), dropout=0.0)


def unet_inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {"sample": torch.randn(2, 4, 8, 8, generator=g),
            "timestep": torch.tensor([917.0, 281.0]),
            "encoder_hidden_states": torch.randn(2, 5, 16, generator=g)}


def labels_for(out: torch.Tensor) -> torch.Tensor:
    rows = zoo.class_rows(out)
    return torch.randint(0, rows.shape[1], (rows.shape[0],), generator=torch.Generator()
                         .manual_seed(5))


def autocast_call(model: torch.nn.Module, inputs: dict):
    def call():
        with zoo.autocast():
            return model(**inputs)
    return call


def test_unet2d_condition_eval_whole_graph_and_a_denoising_loop_captures_once():
    """O2 eval numerics on the first step of a DDIM loop, then the loop's other steps: the
    timestep (a 0-d int64 tensor) is a graph input, so one capture serves them all."""
    from diffusers import DDIMScheduler
    unet, inputs = tiny_unet().eval(), unet_inputs()
    text = inputs["encoder_hidden_states"]
    scheduler = DDIMScheduler(num_train_timesteps=1000)
    scheduler.set_timesteps(3)
    first = (inputs["sample"], scheduler.timesteps[0])
    with torch.no_grad():
        ref = unet(*first, encoder_hidden_states=text).sample
        with zoo.autocast():
            ac = zoo.cosine(unet(*first, encoder_hidden_states=text).sample.float(), ref)
        with dm.count_exports() as exports:
            net = ampgraph.compile(unet, amp_level="O2", dtype="bf16").eval()
            o2 = zoo.cosine(net(*first, encoder_hidden_states=text).sample, ref)
            assert zoo.describe_capture(net)["status"] == "whole graph"
            latents = inputs["sample"]
            for t in scheduler.timesteps:
                noise = net(latents, t, encoder_hidden_states=text).sample
                latents = scheduler.step(noise, t, latents).prev_sample
    assert o2 >= 0.99 and o2 >= ac - 0.005, (o2, ac)
    assert exports.count == 1, f"{exports.count} captures for 1 + 3 calls"
    assert torch.isfinite(latents).all()


def test_unet2d_condition_train_gradients_agree_with_fp32_as_autocast():
    unet = tiny_unet().train()
    model, inputs = dm.Sample(unet), unet_inputs()
    labels = labels_for(model(**inputs).detach())
    fp32 = zoo.train_grads(model, lambda: model(**inputs), labels)
    ac = zoo.cosine(zoo.train_grads(model, autocast_call(model, inputs), labels), fp32)
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16").train()
    o2 = zoo.cosine(zoo.train_grads(model, lambda: net(**inputs), labels), fp32)
    assert zoo.describe_capture(net)["status"] == "whole graph"
    assert o2 >= ac - 0.01, (o2, ac)


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # autocast's
def test_flux_gradients_and_its_time_embedders_agree_with_fp32_as_autocast():
    """Issue 40: Flux's gradients within 0.001 of autocast's agreement with fp32; its time
    embedder's weights (sin/cos of the float timestep, kept fp32 by passes/fx/periodic.py)
    as well: with that mul/sin/cos in bf16 they were at cosine 0.935."""
    torch.manual_seed(0)
    model, inputs = dm.MODELS["flux"].builder().train(), dm.flux_inputs()
    part = dm.time_embedder_slices(model)
    assert part, "Flux's TimestepEmbedding was not found"
    labels = labels_for(model(**inputs).detach())
    fp32 = zoo.train_grads(model, lambda: model(**inputs), labels)
    ac = zoo.train_grads(model, autocast_call(model, inputs), labels)
    net = ampgraph.compile(model, amp_level="O2", dtype="bf16").train()
    o2 = zoo.train_grads(model, lambda: net(**inputs), labels)
    assert zoo.describe_capture(net)["status"] == "whole graph"
    whole = zoo.cosine(o2, fp32), zoo.cosine(ac, fp32)
    assert whole[0] >= whole[1] - 0.001, whole

    def embedder(g: torch.Tensor) -> torch.Tensor:
        return torch.cat([g[s] for s in part])

    te_o2, te_ac = (zoo.cosine(embedder(g), embedder(fp32)) for g in (o2, ac))
    assert te_o2 >= te_ac - 0.001 and te_o2 >= 0.999, (te_o2, te_ac)


class RoundTrip(torch.nn.Module):
    """``vae.decode(vae.encode(x).latent_dist.mean).sample`` of a one-block AutoencoderKL
    (its mid blocks' attention included): both halves in one graph."""

    def __init__(self):
        super().__init__()
        from diffusers import AutoencoderKL
        self.vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                                 down_block_types=("DownEncoderBlock2D",),
                                 up_block_types=("UpDecoderBlock2D",), block_out_channels=(16,),
                                 layers_per_block=1, norm_num_groups=8, sample_size=8)

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(self.vae.encode(sample).latent_dist.mean).sample


def test_autoencoder_kl_encode_and_decode_whole_graph_in_eval():
    torch.manual_seed(0)
    model, x = RoundTrip().eval(), {"sample": torch.randn(2, 3, 8, 8)}
    with torch.no_grad():
        ref = model(**x)
        with zoo.autocast():
            ac = zoo.cosine(model(**x).float(), ref)
        net = ampgraph.compile(model, amp_level="O2", dtype="bf16").eval()
        o2 = zoo.cosine(net(**x), ref)
    assert zoo.describe_capture(net)["status"] == "whole graph"
    assert o2 >= 0.99 and o2 >= ac - 0.005, (o2, ac)
