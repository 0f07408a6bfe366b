"""diffusers' models from small configs through ampgraph O2 (bf16), measured as the zoo measures.

    python benchmarks/diffusers_models.py                      # every model + the denoising loops
    python benchmarks/diffusers_models.py --models flux,sd3 --json diffusers.json

Nothing is downloaded: each model is built with random weights from a small config (widths
32-64, one or two layers or blocks, 8-16 px latents, every dropout 0). Per model, the zoo's
own measurement (``benchmarks/zoo.py``'s ``run_model``, imported, not copied; docs/zoo.md
"What each column is"): capture in eval and train mode, O2 eval cosine vs fp32 beside
autocast's, train-mode gradient cosines beside autocast's, the bf16 floor; plus the seconds
of capture and first call, the gradient cosines of the time embedder's weights alone (issue
40, item 7) and of the parameter where O2 is furthest below autocast, and five AdamW steps
of ``ampgraph.build_train_step`` (an MSE on a fixed random target) against fp32's.

The loss is the zoo's: cross-entropy over the output's channels (``.sample``: (B, C, H, W)
for the U-Nets, the VAE and DiT/SD3; (B, tokens, C) for Flux) with fixed random labels.
AutoencoderKL is measured twice, through small wrappers: ``encode(x).latent_dist.mean`` and
``decode(z).sample``.

The denoising loops: the compiled UNet2DConditionModel under DDIMScheduler's steps and the
compiled Flux transformer under FlowMatchEulerDiscreteScheduler's, in eval mode, the
timestep a tensor input; each counts ``torch.export`` calls (one expected) and compares the
final latents with the fp32 loop's.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import zoo  # noqa: E402  (benchmarks/zoo.py: the measurement)

import ampgraph  # noqa: E402
import ampgraph.capture.cache as cache  # noqa: E402

BATCH, TEXT = 2, 7


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _timesteps(scale: float = 1000.0) -> torch.Tensor:
    """Float timesteps, one per sample (a tensor: never a constant of the graph)."""
    return torch.tensor([0.917, 0.281])[:BATCH] * scale


# -- models --------------------------------------------------------------------------------


def unet2d() -> nn.Module:
    from diffusers import UNet2DModel
    return UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1,
                       block_out_channels=(32, 64), norm_num_groups=8, attention_head_dim=8,
                       down_block_types=("DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D"), dropout=0.0)


def unet2d_inputs() -> dict[str, torch.Tensor]:
    return {"sample": torch.randn(BATCH, 3, 16, 16, generator=_gen(1)),
            "timestep": _timesteps()}


def unet2d_condition() -> nn.Module:
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel(
        sample_size=16, in_channels=4, out_channels=4, layers_per_block=1,
        block_out_channels=(32, 64), norm_num_groups=8, cross_attention_dim=32,
        attention_head_dim=8, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), dropout=0.0)


def unet2d_condition_inputs() -> dict[str, torch.Tensor]:
    return {"sample": torch.randn(BATCH, 4, 16, 16, generator=_gen(2)),
            "timestep": _timesteps(),
            "encoder_hidden_states": torch.randn(BATCH, TEXT, 32, generator=_gen(3))}


def autoencoder_kl() -> nn.Module:
    from diffusers import AutoencoderKL
    return AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",) * 2,
                         up_block_types=("UpDecoderBlock2D",) * 2,
                         block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8,
                         sample_size=16)


class VaeEncode(nn.Module):
    """``vae.encode(sample).latent_dist.mean``: the encoder and its quant conv."""

    def __init__(self, vae: nn.Module | None = None):
        super().__init__()
        self.vae = vae if vae is not None else autoencoder_kl()

    def forward(self, sample: torch.Tensor) -> torch.Tensor:
        return self.vae.encode(sample).latent_dist.mean


class VaeDecode(nn.Module):
    """``vae.decode(latents).sample``: the post-quant conv and the decoder."""

    def __init__(self, vae: nn.Module | None = None):
        super().__init__()
        self.vae = vae if vae is not None else autoencoder_kl()

    def forward(self, latents: torch.Tensor) -> torch.Tensor:
        return self.vae.decode(latents).sample


def vae_encode_inputs() -> dict[str, torch.Tensor]:
    return {"sample": torch.randn(BATCH, 3, 16, 16, generator=_gen(4))}


def vae_decode_inputs() -> dict[str, torch.Tensor]:
    return {"latents": torch.randn(BATCH, 4, 8, 8, generator=_gen(5))}


def dit() -> nn.Module:
    from diffusers import DiTTransformer2DModel
    from diffusers.models.embeddings import LabelEmbedding
    model = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=16, in_channels=4,
                                  num_layers=2, sample_size=8, patch_size=2, dropout=0.0,
                                  num_embeds_ada_norm=1000)
    for m in model.modules():  # classifier-free guidance's label dropout (0.1, not a config
        if isinstance(m, LabelEmbedding):  # argument): random labels in train mode
            m.dropout_prob = 0.0
    return model


def dit_inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(BATCH, 4, 8, 8, generator=_gen(6)),
            "timestep": _timesteps(),
            "class_labels": torch.tensor([3, 711])[:BATCH]}


def sd3() -> nn.Module:
    from diffusers import SD3Transformer2DModel
    return SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4,
                                 num_layers=2, attention_head_dim=16, num_attention_heads=2,
                                 joint_attention_dim=32, caption_projection_dim=32,
                                 pooled_projection_dim=16, pos_embed_max_size=16)


def sd3_inputs() -> dict[str, torch.Tensor]:
    return {"hidden_states": torch.randn(BATCH, 4, 8, 8, generator=_gen(7)),
            "encoder_hidden_states": torch.randn(BATCH, TEXT, 32, generator=_gen(8)),
            "pooled_projections": torch.randn(BATCH, 16, generator=_gen(9)),
            "timestep": _timesteps()}


def flux() -> nn.Module:
    from diffusers import FluxTransformer2DModel
    return FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1,
                                  num_single_layers=1, attention_head_dim=16,
                                  num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=16, axes_dims_rope=(4, 6, 6))


def flux_inputs() -> dict[str, torch.Tensor]:
    img = torch.stack(torch.meshgrid(torch.zeros(1), torch.arange(4.0), torch.arange(4.0),
                                     indexing="ij"), -1).reshape(16, 3)
    return {"hidden_states": torch.randn(BATCH, 16, 16, generator=_gen(10)),
            "encoder_hidden_states": torch.randn(BATCH, TEXT, 32, generator=_gen(11)),
            "pooled_projections": torch.randn(BATCH, 16, generator=_gen(12)),
            "timestep": _timesteps(1.0),  # Flux scales t in [0, 1] by 1000 itself
            "img_ids": img, "txt_ids": torch.zeros(TEXT, 3)}


class Sample(nn.Module):
    """``model(**inputs).sample``, the output the zoo's loss and cosines read (its
    ``logits_of`` knows ``.logits``, not diffusers' ``.sample``)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(**inputs, return_dict=False)[0]


def _entry(builder: Callable[[], nn.Module], inputs: Callable[[], dict], family: str,
           sample: bool = True) -> zoo.Entry:
    return zoo.Entry(builder=(lambda: Sample(builder())) if sample else builder,
                     inputs=inputs, family=family)


MODELS: dict[str, zoo.Entry] = {
    "unet2d": _entry(unet2d, unet2d_inputs, "UNet2DModel"),
    "unet2d_condition": _entry(unet2d_condition, unet2d_condition_inputs,
                               "UNet2DConditionModel"),
    "vae_encode": _entry(VaeEncode, vae_encode_inputs, "AutoencoderKL.encode", False),
    "vae_decode": _entry(VaeDecode, vae_decode_inputs, "AutoencoderKL.decode", False),
    "dit": _entry(dit, dit_inputs, "DiTTransformer2DModel"),
    "sd3": _entry(sd3, sd3_inputs, "SD3Transformer2DModel"),
    "flux": _entry(flux, flux_inputs, "FluxTransformer2DModel"),
}

# -- the time embedder's gradients -----------------------------------------------------------


def parameter_slices(model: nn.Module) -> dict[str, slice]:
    """Where each parameter lies in ``zoo.flat_grads``' vector, by name."""
    out, offset = {}, 0
    for name, p in model.named_parameters():
        out[name] = slice(offset, offset + p.numel())
        offset += p.numel()
    return out


def time_embedder_slices(model: nn.Module) -> list[slice]:
    """Where the sinusoidal timestep embedder's parameters lie in ``zoo.flat_grads``' vector:
    diffusers' ``TimestepEmbedding`` modules (``time_embedding``, ``timestep_embedder``)."""
    from diffusers.models.embeddings import TimestepEmbedding
    where = parameter_slices(model)
    return [where[f"{path}.{name}" if path else name]
            for path, m in model.named_modules() if isinstance(m, TimestepEmbedding)
            for name, _ in m.named_parameters()]


def gradient_parts(entry: zoo.Entry) -> dict[str, Any]:
    """Train-mode gradients vs fp32 part by part, where one flat cosine could hide a module:
    ``time_embedder``, the cosines of the time embedder's weights alone (O2, autocast, bf16
    floor; None without a TimestepEmbedding), and ``worst_parameter``, the parameter whose
    O2 gradient cosine falls furthest below autocast's (parameters whose fp32 gradient is
    under 1e-6 of the whole's norm left out)."""
    torch.manual_seed(0)
    model = entry.builder()
    inputs = entry.inputs()
    model.eval()
    with torch.no_grad():
        ref = zoo.logits_of(model(**inputs)).float()
    labels = torch.randint(0, zoo.class_rows(ref).shape[1], (zoo.class_rows(ref).shape[0],),
                           generator=_gen(5))
    model.train()
    fp32 = zoo.train_grads(model, lambda: model(**inputs), labels)

    def ac_call() -> Any:
        with zoo.autocast():
            return model(**inputs)

    with zoo.quiet():
        net = ampgraph.compile(model, amp_level="O2", dtype="bf16").train()
        o2 = zoo.train_grads(model, lambda: net(**inputs), labels)
        ac = zoo.train_grads(model, ac_call, labels)
        with zoo.bf16_rounded(model, inputs) as rounded:
            floor = zoo.train_grads(model, lambda: model(**rounded), labels)
    out: dict[str, Any] = {"time_embedder": None}
    slices = time_embedder_slices(model)
    if slices:
        def part(grads: torch.Tensor) -> torch.Tensor:
            return torch.cat([grads[s] for s in slices])
        out["time_embedder"] = {k: zoo.cosine(part(g), part(fp32))
                                for k, g in (("o2", o2), ("autocast", ac), ("bf16_floor", floor))}
    worst = None
    for name, s in parameter_slices(model).items():
        if fp32[s].norm() < 1e-6 * fp32.norm():
            continue
        c_o2, c_ac = zoo.cosine(o2[s], fp32[s]), zoo.cosine(ac[s], fp32[s])
        if worst is None or c_o2 - c_ac < worst["o2"] - worst["autocast"]:
            worst = {"name": name, "o2": c_o2, "autocast": c_ac}
    out["worst_parameter"] = worst
    return out


def train_steps(entry: zoo.Entry, steps: int = 5) -> dict[str, Any]:
    """``steps`` AdamW steps (lr 1e-3) on an MSE against a fixed random target, from the same
    weights: fp32, autocast, and ``ampgraph.build_train_step`` (O2 bf16). Returns each
    one's losses and the cosine of its total parameter update with fp32's."""
    import copy

    torch.manual_seed(0)
    base = entry.builder().train()
    inputs = entry.inputs()
    with torch.no_grad():
        target = torch.randn(zoo.logits_of(base(**inputs)).shape, generator=_gen(13))

    def mse(out: Any, t: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(zoo.logits_of(out).float(), t)

    def flat(model: nn.Module) -> torch.Tensor:
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    start, out = flat(base), {}
    for mode in ("fp32", "autocast", "O2"):
        model = copy.deepcopy(base)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        if mode == "O2":
            with zoo.quiet():
                step = ampgraph.build_train_step(model, mse, opt, amp_level="O2", dtype="bf16")
                losses = [float(step(target, **inputs).loss) for _ in range(steps)]
        else:
            for _ in range(steps):
                opt.zero_grad(set_to_none=True)
                with torch.autocast("cpu", torch.bfloat16, enabled=mode == "autocast"):
                    output = model(**inputs)
                loss = mse(output, target)
                loss.backward()
                opt.step()
                losses.append(float(loss))
        out[mode] = {"losses": losses, "update": flat(model) - start}
    return {"steps": steps, "losses": {k: v["losses"] for k, v in out.items()},
            "update_cos": {k: zoo.cosine(out[k]["update"], out["fp32"]["update"])
                           for k in ("O2", "autocast")}}


# -- the denoising loop ----------------------------------------------------------------------


def unet_ddim_step(steps: int) -> tuple[nn.Module, Callable[[Callable[..., Any]], tuple]]:
    """The UNet2DConditionModel and a DDIM loop of ``steps`` steps over it (0-d int64
    timesteps, the way pipelines pass them)."""
    from diffusers import DDIMScheduler

    torch.manual_seed(0)
    unet = unet2d_condition().eval()
    text = torch.randn(BATCH, TEXT, 32, generator=_gen(3))
    start = torch.randn(BATCH, 4, 16, 16, generator=_gen(2))

    def run(model: Callable[..., Any]) -> tuple[torch.Tensor, list[float]]:
        scheduler = DDIMScheduler(num_train_timesteps=1000)
        scheduler.set_timesteps(steps)
        latents, seen = start.clone(), []
        for t in scheduler.timesteps:
            seen.append(round(float(t), 3))
            noise = model(latents, t, encoder_hidden_states=text).sample
            latents = scheduler.step(noise, t, latents).prev_sample
        return latents, seen
    return unet, run


def flux_flow_match(steps: int) -> tuple[nn.Module, Callable[[Callable[..., Any]], tuple]]:
    """The Flux transformer and a FlowMatchEulerDiscreteScheduler loop of ``steps`` steps
    (float timesteps: sigma times 1000; Flux takes sigma)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)
    model = flux().eval()
    inputs = flux_inputs()

    def run(net: Callable[..., Any]) -> tuple[torch.Tensor, list[float]]:
        scheduler = FlowMatchEulerDiscreteScheduler()
        scheduler.set_timesteps(steps)
        latents, seen = inputs["hidden_states"].clone(), []
        for t in scheduler.timesteps:
            seen.append(round(float(t), 3))
            noise = net(**{**inputs, "hidden_states": latents,
                           "timestep": (t / 1000).expand(BATCH)}).sample
            latents = scheduler.step(noise, t, latents).prev_sample
        return latents, seen
    return model, run


LOOPS = {"UNet2DConditionModel + DDIMScheduler": unet_ddim_step,
         "FluxTransformer2DModel + FlowMatchEulerDiscreteScheduler": flux_flow_match}


def denoising_loop(make: Callable[[int], tuple], steps: int = 4) -> dict[str, Any]:
    """A scheduler loop of ``steps`` steps with the compiled model (eval, O2 bf16): how many
    times ``torch.export`` ran (the timestep is a tensor input: one capture serves every
    step), the timesteps, and the final latents' cosine with the fp32 loop's."""
    model, run = make(steps)
    with count_exports() as exports, zoo.quiet(), torch.no_grad():
        net = ampgraph.compile(model, amp_level="O2", dtype="bf16").eval()
        t0 = time.perf_counter()
        ours, seen = run(net)
        seconds = time.perf_counter() - t0
    with torch.no_grad():
        ref, _ = run(model)
    return {"steps": steps, "timesteps": seen, "captures": exports.count,
            "capture": zoo.describe_capture(net)["status"],
            "latents_cos": zoo.cosine(ours, ref), "seconds": round(seconds, 2)}


class count_exports:  # noqa: N801 - used as a context manager, like a function
    """Counts the ``torch.export`` captures ampgraph's modules make inside the block (every
    capture goes through ``ampgraph.capture.cache.export_module``)."""

    def __init__(self) -> None:
        self.count = 0

    def __enter__(self) -> count_exports:
        self.real = real = cache.export_module

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.count += 1
            return real(*args, **kwargs)
        cache.export_module = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        cache.export_module = self.real


# -- output ------------------------------------------------------------------------------


def first_call_seconds(row: dict) -> str:
    s = row["seconds"]
    return f'{s.get("compile", 0) + s.get("o2_eval", 0):.1f} / {s.get("o2_train", 0):.1f}'


def worst_cell(worst: dict | None) -> str:
    if not worst:
        return "-"
    return f'{zoo.fmt(worst["o2"])} / {zoo.fmt(worst["autocast"])} (`{worst["name"]}`)'


def steps_cell(steps: dict | None) -> str:
    if not steps:
        return "-"
    cos = steps["update_cos"]
    return f'{zoo.fmt(cos["O2"])} / {zoo.fmt(cos["autocast"])}'


def table(rows: list[dict]) -> str:
    head = ["model", "class", "capture", "O2 eval cos", "autocast eval cos", "O2 grad cos",
            "autocast grad cos", "bf16 floor eval / grad", "time embedder grad cos: "
            "O2 / autocast / floor", "worst parameter grad cos: O2 / autocast",
            "5 AdamW steps: update cos O2 / autocast",
            "capture + first call s: eval / train", "criteria"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        te = r.get("time_embedder")
        crit = zoo.criteria(r)
        ok = [k for k in ("whole graph", "eval", "grad") if crit[k] is False]
        cells = [r["model"], r["family"], zoo.capture_cell(r), zoo.fmt(r.get("o2_eval_cos")),
                 zoo.fmt(r.get("autocast_eval_cos")), zoo.fmt(r.get("o2_grad_cos")),
                 zoo.fmt(r.get("autocast_grad_cos")),
                 f'{zoo.fmt(r.get("bf16_floor_eval_cos"))} / '
                 f'{zoo.fmt(r.get("bf16_floor_grad_cos"))}',
                 " / ".join(zoo.fmt(te[k]) for k in ("o2", "autocast", "bf16_floor"))
                 if te else "-", worst_cell(r.get("worst_parameter")),
                 steps_cell(r.get("train_steps")), first_call_seconds(r),
                 "pass" if not ok else "fails: " + ", ".join(ok)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    torch.set_num_threads(int(os.environ.get("DIFFUSERS_BENCH_THREADS", "1")))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", help=f"comma-separated (default: all): {','.join(MODELS)}")
    parser.add_argument("--skip-loop", action="store_true", help="skip the denoising loop")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    names = zoo.chosen(parser, args.models, MODELS)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        row = zoo.run_model(name, MODELS[name], skip_onnx=True, skip_speed=True, repeats=0)
        parts = zoo.step(row, "gradient_parts",
                         lambda entry=MODELS[name]: gradient_parts(entry)) or {}
        row["time_embedder"] = parts.get("time_embedder")
        row["worst_parameter"] = parts.get("worst_parameter")
        row["train_steps"] = zoo.step(row, "train_steps",
                                      lambda entry=MODELS[name]: train_steps(entry))
        row["total_seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
        print(f"[{name}] {zoo.capture_cell(row)} in {row['total_seconds']} s", file=sys.stderr,
              flush=True)
    print(table(rows))
    print("\n" + zoo.summary(rows))
    more = zoo.details(rows)
    if more:
        print("\n" + more)
    loops = {}
    if not args.skip_loop:
        print()
        for what, make in LOOPS.items():
            loop = loops[what] = denoising_loop(make)
            print(f"denoising loop, {what}, {loop['steps']} steps (timesteps "
                  f"{loop['timesteps']}): {loop['captures']} capture(s), {loop['capture']}, "
                  f"final latents cos vs fp32 {loop['latents_cos']:.5f}")
    if args.json:
        meta = {"date": datetime.date.today().isoformat(), "torch": torch.__version__,
                "command": " ".join(["python", "benchmarks/diffusers_models.py",
                                     *(argv if argv is not None else sys.argv[1:])]),
                "threads": torch.get_num_threads()}
        for row in rows:
            row["criteria"] = zoo.criteria(row)
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "summary": zoo.summary(rows), "models": rows,
                       "denoising_loops": loops}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
