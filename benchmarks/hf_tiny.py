"""Tiny random models of transformers' architectures, from their shrunk default configs.

``build(arch, kind, class_name)`` gives the fp32 model (random weights, every dropout 0) and
its inputs for one architecture of transformers' auto mappings (``kind``: causal, masked,
seq2seq, seqcls or image), built from ``shrunk_config(arch)``: the architecture's default
config with its sizes shrunk by name, sub-configs (text_config, vision_config, encoder,
decoder, ...) alike, so that what the constructor derives follows and the result stays
valid (heads divide the width, per-layer lists keep representative layers, a hierarchical
vision model keeps two stages). Nothing is downloaded. benchmarks/hf_sweep.py runs every
architecture this way (docs/zoo.md, "Across transformers' architectures").
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers (and huggingface_hub) import

import torch  # noqa: E402
from torch import nn  # noqa: E402
from zoo import no_dropout, one_line, quiet  # noqa: E402

BATCH, SEQ, VOCAB, IMG, LABELS = 2, 12, 128, 32, 5
BN_BATCH, BN_IMG = 4, 64  # batch-norm models, as the zoo's BN_IMAGES (docs/zoo.md)
WIDTH, LAYERS, HEADS, HEAD_DIM, FFN, EXPERTS, STAGES = 32, 2, 2, 16, 64, 4, 2
INPUT_IDS = (3, VOCAB - 28)  # random token ids; special ids are moved above this range

LAYER_NAMES = {"num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers",
               "decoder_layers", "num_decoder_layers", "num_encoder_layers", "depth",
               "num_self_attends_per_block", "num_blocks"}
HEAD_NAMES = {"num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads",
              "encoder_attention_heads", "decoder_attention_heads", "index_n_heads",
              "linear_num_key_heads", "linear_num_value_heads", "swa_num_attention_heads",
              "linear_num_heads", "num_self_attention_heads", "num_cross_attention_heads"}
EXPERT_COUNTS = {"num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"}
TOP_K = {"num_experts_per_tok", "moe_topk", "moe_top_k", "num_experts_per_token", "moe_k"}
NAMES: list[tuple[int, set[str]]] = [  # (new int value, constructor parameters)
    (WIDTH, {"hidden_size", "d_model", "n_embd", "embed_dim", "dim", "embedding_size",
             "emb_dim", "d_embed", "embedding_dim", "word_embed_proj_dim", "projection_dim",
             "attention_hidden_size", "hidden_size_global", "audio_hidden_size",
             "text_hidden_size", "vision_hidden_size", "encoder_hidden_size", "d_latents",
             "adapter_in_dim", "adapter_input_size", "adapter_out_dim"}),
    (LAYERS, LAYER_NAMES),
    (HEADS, HEAD_NAMES),
    (HEAD_DIM, {"head_dim", "d_kv", "attention_head_dim", "dim_head", "d_head", "kv_channels",
                "v_head_dim", "qk_nope_head_dim", "index_head_dim", "swa_head_dim",
                "linear_key_head_dim", "linear_value_head_dim", "mamba_d_head",
                "mamba_head_dim", "kv_lora_rank", "q_lora_rank", "o_lora_rank",
                "linear_head_dim", "hidden_size_per_layer_input", "num_latents"}),
    (HEAD_DIM // 2, {"qk_rope_head_dim", "rotary_dim", "mamba_dt_rank", "time_step_rank"}),
    (FFN // 2, {"moe_intermediate_size", "expert_ffn_hidden_size"}),
    (FFN, {"intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff",
           "n_inner", "dim_ff", "dff", "ffn_hidden_size", "hidden_dim", "d_inner",
           "shared_expert_intermediate_size", "shared_intermediate_size",
           "intermediate_size_mlp", "moe_shared_expert_intermediate_size",
           "shared_experts_intermediate_size"}),
    (EXPERTS, EXPERT_COUNTS),
    (0, {"num_kv_shared_layers"}),
    (2, {"zero_expert_num"}),
    (1, {"n_shared_experts", "num_shared_experts", "moe_num_shared_experts", "n_group",
         "topk_group", "num_expert_group", "first_k_dense_replace", "n_groups",
         "mamba_n_groups"}),
]
BY_NAME = {name: value for value, names in NAMES for name in names}
KV_HEADS = {"num_key_value_heads", "num_kv_heads", "kv_n_heads", "n_kv_heads",
            "swa_num_key_value_heads"}
POSITIONS = {"max_position_embeddings", "n_positions", "n_ctx", "max_target_positions",
             "max_encoder_position_embeddings", "max_decoder_position_embeddings",
             "max_2d_position_embeddings"}
STAGE_WIDTHS = {"hidden_sizes", "embed_dims", "embed_dim"}  # per-stage lists (vision)
STAGE_HEADS = {"num_heads", "num_attention_heads"}
STAGE_DEPTHS = {"depths", "depth"} | LAYER_NAMES
PICKS = {  # where hybrid models put their attention layers: within the first LAYERS
    "attn_layer_period": LAYERS, "attn_layer_offset": LAYERS - 1,  # Jamba
    "attention_window": 8,  # Longformer, LED: pad the sequence to 16, not 512
}
SCALES = {"width_coefficient", "depth_coefficient", "depth_multiplier", "width_multiplier"}


@dataclass
class Shrink:
    """What the rules of one config need: ``ids`` (special token ids moved so far, shared
    by the sub-configs), the image size, the channel divisor of a vision config (its first
    stage width / 16) and its stage count (``len(depths)``, cut to ``STAGES``)."""

    ids: dict[int, int]
    image: int
    factor: int = 1
    stages: int | None = None
    small_vocab: bool = False  # its vocabulary is already <= VOCAB: the ids stay


def shrink_value(name: str, value: Any, default: Any, ctx: Shrink) -> Any:
    """The shrunk value of one constructor parameter (``value`` itself when unchanged);
    ``default``: the default config, for the rules that depend on other parameters."""
    if value is None and name in KV_HEADS | {"head_dim"}:
        return HEADS if name in KV_HEADS else HEAD_DIM  # some defaults leave them unset
    if name == "attn_layer_indices":  # Bamba: None (no attention layer) or indices
        return [LAYERS - 1]
    if isinstance(value, bool) or value is None:
        return value
    if name.endswith(("block_types", "layer_types")) and isinstance(value, (list, tuple)) \
            and len(value) > LAYERS:  # a repeating pattern (RecurrentGemma)
        return representative(value)
    if name == "attention_window" and isinstance(value, list):
        return [PICKS[name]] * len(value)
    if isinstance(value, (list, tuple)) and ctx.stages and (
            len(value) == ctx.stages or (len(value) == ctx.stages - 1 and "down" in name)):
        # per-stage lists of hierarchical vision models (and LeViT's between stages)
        value = value[:STAGES - (len(value) < ctx.stages)]
    if isinstance(value, (list, tuple)) and value and "drop" in name and all(
            isinstance(v, float) for v in value):
        return type(value)([0.0] * len(value))  # per-stage dropout rates
    if isinstance(value, float):
        if "drop" in name or "jitter" in name:
            return 0.0  # dropout, attention/path/layer drop, router jitter: deterministic
        if name in SCALES:  # EfficientNet, MobileNet, MobileViT width/depth multipliers
            return min(value, 0.25)
        return value
    if name.endswith(("token_id", "token_index", "token_ids")) and not ctx.small_vocab:
        return remap_ids(value, ctx.ids)
    channels = name in STAGE_WIDTHS or ("channels" in name and name != "num_channels")
    if isinstance(value, int):
        if name in KV_HEADS:
            stored = vars(default)  # not getattr: a per-layer config refuses global reads
            heads = next((stored[n] for n in ("num_attention_heads", "n_head", "num_heads")
                          if isinstance(stored.get(n), int)), value)
            return 1 if value < heads else HEADS
        if name in TOP_K:
            return min(value, 2)
        if name in LAYER_NAMES | HEAD_NAMES:
            return min(value, BY_NAME[name])
        if name in BY_NAME:
            return BY_NAME[name]
        if name in PICKS:
            return PICKS[name]
        if "vocab" in name:
            return min(value, VOCAB)
        if name in POSITIONS:
            return min(value, 128)
        if name == "image_size":
            return ctx.image
        if name in ("num_stages", "num_encoder_blocks") and ctx.stages:
            return min(value, STAGES)
        if name == "num_query_pool" and ctx.stages:  # Hiera: pooling between stages
            return min(value, STAGES - 1)
        if name == "window_size" and ctx.stages:  # Swin: the last stage holds a window
            return min(value, 4)
        if name == "groups_width":  # RegNet: channels per group
            return 8
        if name == "num_groups":  # group norm (BiT)
            return min(value, 4)
        if channels:
            return scaled(value, ctx.factor)
        return value
    if isinstance(value, (list, tuple)) and value and all(
            isinstance(v, int) and not isinstance(v, bool) for v in value):
        if name == "image_size":
            return type(value)([ctx.image] * len(value))
        if channels:
            return type(value)([scaled(v, ctx.factor) for v in value])
        if name in STAGE_HEADS:
            return type(value)([min(v, 2) for v in value])
        if name in STAGE_DEPTHS:  # CvT indexes stage i's drop-path rates by i
            return type(value)([min(v, i + 1) for i, v in enumerate(value)])
        if name in BY_NAME:  # per-layer values (Gemma-3n's intermediate sizes)
            return type(value)([BY_NAME[name]] * len(value))
    return value


def scaled(channels: int, factor: int) -> int:
    """A channel count divided by ``factor`` and rounded to a multiple of 8 (heads and
    groups divide it); equal counts stay equal, so stage n's output still feeds stage n+1.
    Counts under 16 (image channels, tiny stems) are kept."""
    if factor <= 1 or channels < 16:
        return channels
    return max(8, int(channels / factor / 8 + 0.5) * 8)


def remap_ids(value: Any, ids: dict[int, int]) -> Any:
    """Special token ids outside 0-2 move to the top of the shrunk vocabulary (the same id
    to the same new id across the whole config), above the random input ids."""
    if isinstance(value, (list, tuple)):
        return type(value)(remap_ids(v, ids) for v in value)
    if not isinstance(value, int) or isinstance(value, bool) or value < INPUT_IDS[0]:
        return value
    if value not in ids:
        ids[value] = VOCAB - 1 - len(ids) % (VOCAB - INPUT_IDS[1])
    return ids[value]


def consistent(over: dict[str, Any], default: Any, params: Any) -> None:
    """Cross-parameter constraints the per-name rules do not keep."""
    def get(name: str) -> Any:
        if name in over:
            return over[name]
        try:
            return getattr(default, name, None)
        except Exception:  # noqa: BLE001 - a per-layer config refuses global reads
            return vars(default).get(name)

    # Mamba-2 style mixers: heads x head dim == the mixer's width (expand x hidden)
    for heads, head_dim, expand in (("num_heads", "head_dim", "expand"),
                                    ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
                                    ("mamba_num_heads", "mamba_head_dim", "mamba_expand")):
        if all(isinstance(get(n), int) for n in (heads, head_dim, expand, "hidden_size")) \
                and hasattr(default, "state_size" if heads == "num_heads" else heads):
            inner = get(expand) * get("hidden_size")
            if isinstance(get("mamba_d_ssm"), int):
                over["mamba_d_ssm"] = inner
            over[heads] = inner // get(head_dim)
    experts = next((get(n) for n in EXPERT_COUNTS if isinstance(get(n), int)), None)
    for name in TOP_K & set(params):
        if experts is not None:  # DeepSeek-V2's default leaves the top-k unset
            over[name] = min(get(name) or 2, experts)
    if "qk_rope_head_dim" in over and "head_dim" in over:  # MLA: rotary on the rope part
        over["head_dim"] = over["qk_rope_head_dim"]
    types = get("attention_types")  # GPT-Neo: [[pattern, repeats]] spelling out the layers
    if isinstance(types, list) and len(types) == 1 and isinstance(types[0][0], list):
        over["attention_types"] = [[types[0][0], max(1, LAYERS // len(types[0][0]))]]
    if getattr(default, "model_type", None) == "codegen":  # its attention splits the
        over["n_head"] = 4                                 # heads 4 ways (mp_num)
    if "width_coefficient" in over and isinstance(get("hidden_dim"), int):
        # EfficientNet: the head's width is the scaled last stage's
        width = default.hidden_dim * over["width_coefficient"] / default.width_coefficient
        over["hidden_dim"] = max(8, int(width) // 8 * 8)


def representative(layers: Any) -> Any:
    """``LAYERS`` entries of a per-layer list (or pattern string), in order, covering as many
    distinct entries as fit: e.g. a sliding-window layer and a full-attention one."""
    firsts = {}
    for i, v in enumerate(layers):
        firsts.setdefault(v if isinstance(v, (str, int, float)) else repr(v), i)
    keep = sorted(list(firsts.values())[:LAYERS])
    keep += [i for i in range(len(layers)) if i not in keep][:LAYERS - len(keep)]
    picked = [layers[i] for i in sorted(keep)]
    return "".join(picked) if isinstance(layers, str) else type(layers)(picked)


def shrunk_config(arch: str, image: int = IMG, cut_stages: bool = True) -> Any:
    """The default config of ``arch`` with every size shrunk (see ``shrink_value``);
    ``cut_stages``: a hierarchical vision model keeps its first ``STAGES`` stages only."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return rebuilt(CONFIG_MAPPING[arch](), {}, image, cut_stages)


def rebuilt(default: Any, ids: dict[int, int], image: int, cut_stages: bool = True) -> Any:
    """A config of ``default``'s class built from its shrunk constructor parameters (so what
    the constructor derives follows), sub-configs first. Per-layer lists keep representative
    layers (``representative``)."""
    from transformers import PretrainedConfig

    params = inspect.signature(type(default).__init__).parameters
    value = vars(default)
    layers = next((value[n] for n in LAYER_NAMES
                   if n in params and isinstance(value.get(n), int)), None)
    vocab = value.get("vocab_size")
    ctx = Shrink(ids, image, small_vocab=isinstance(vocab, int) and vocab <= VOCAB)
    stage_list = next((value[n] for n in ("depths", "depth") if n in params
                       and isinstance(value.get(n), (list, tuple))), None)
    if cut_stages and stage_list and len(stage_list) > STAGES:
        ctx.stages = len(stage_list)
    width = next((value[n] for n in ("hidden_sizes", "embed_dims", "embed_dim")
                  if n in params and isinstance(value.get(n), (list, tuple))), None)
    if width:
        ctx.factor = max(1, width[0] // 16)
    patch = value.get("patch_size")
    if isinstance(patch, int) and 2 * patch > image:
        ctx.image = 2 * patch  # at least 2 x 2 patches

    def per_layer(name: str, value: Any) -> bool:
        return (bool(layers) and layers > LAYERS and not name.startswith("_")
                and (isinstance(value, (list, tuple)) or (isinstance(value, str)
                                                          and "pattern" in name))
                and len(value) == layers)

    over: dict[str, Any] = {}
    for name, value in vars(default).items():
        if isinstance(value, PretrainedConfig):
            over[name] = rebuilt(value, ids, image, cut_stages)
        elif name in params and not name.startswith("_"):
            new = shrink_value(name, value, default, ctx)
            new = representative(new) if per_layer(name, new) else new
            if new is not value:
                over[name] = new
    consistent(over, default, params)
    cfg = type(default)(**over)
    for name, value in vars(cfg).items():  # per-layer lists the constructor did not rebuild
        if name not in over and per_layer(name, value):
            setattr(cfg, name, representative(value))
    return cfg


# -- models and inputs -------------------------------------------------------------------


def build(arch: str, kind: str, class_name: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The tiny fp32 model (random weights, dropout 0) and its inputs. As the auto classes'
    ``from_config`` does, a class made for a composite config's text part gets that part.
    Image models with batch norm are rebuilt at 64 px and fed a batch of 4 (docs/zoo.md,
    measurement choices). A hierarchical vision model that does not build or run with its
    stages cut to ``STAGES`` (LeViT, CvT) keeps them all."""
    try:
        return build_once(arch, kind, class_name, cut_stages=True)
    except Exception:
        if kind != "image":
            raise
        try:
            return build_once(arch, kind, class_name, cut_stages=False)
        except Exception:  # noqa: BLE001 - the first error is the one to report
            pass
        raise


def build_once(arch: str, kind: str, class_name: str,
               cut_stages: bool) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    import transformers

    cls = getattr(transformers, class_name)

    def make(image: int) -> nn.Module:
        cfg = config_for(cls, shrunk_config(arch, image, cut_stages))
        if kind in ("seqcls", "image"):
            cfg.num_labels = LABELS
        if kind == "seqcls" and getattr(cfg, "pad_token_id", 0) is None:
            cfg.pad_token_id = 0  # batch > 1 needs one; the inputs never contain it
        torch.manual_seed(0)
        return no_dropout(cls(cfg)).float()

    model, batch = make(IMG), BATCH
    if kind == "image" and any(isinstance(m, nn.modules.batchnorm._BatchNorm)
                               for m in model.modules()):
        model, batch = make(BN_IMG), BN_BATCH
    inputs = inputs_for(model, kind, batch)
    if kind == "image" and cut_stages:  # does the cut model run?
        with torch.no_grad():
            model.eval()(**inputs)
    return model, inputs


def config_for(cls: type, cfg: Any) -> Any:
    """``cfg``, or its sub-config of the class's config class: as the auto classes'
    ``from_config`` does, a class made for a composite config's text part gets that part."""
    from transformers import PretrainedConfig

    want = getattr(cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    return next((v for v in vars(cfg).values()
                 if isinstance(v, PretrainedConfig) and isinstance(v, want)), cfg)


def default_fails(arch: str, class_name: str) -> str | None:
    """The error of building ``arch`` from its unshrunk default config (on the meta device:
    no memory, no init), or None: tells the shrinker's faults from transformers' own."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        with quiet(), torch.device("meta"):
            cls = getattr(transformers, class_name)
            cls(config_for(cls, CONFIG_MAPPING[arch]()))
    except Exception as exc:  # noqa: BLE001
        return one_line(exc)
    return None


def inputs_for(model: nn.Module, kind: str, batch: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    if kind == "image":
        cfg = model.config
        cfg = cfg if hasattr(cfg, "image_size") else getattr(cfg, "vision_config", cfg)
        size = getattr(cfg, "image_size", IMG)
        h, w = (size, size) if isinstance(size, int) else tuple(size)[:2]
        channels = getattr(cfg, "num_channels", 3)
        out = {"pixel_values": torch.randn(batch, channels, h, w, generator=g)}
    else:
        try:
            rows = getattr(model.get_input_embeddings(), "num_embeddings", VOCAB)
        except NotImplementedError:  # CANINE embeds code points by hashing
            rows = VOCAB
        rows = min(rows, VOCAB)  # a small vocabulary (ESM) bounds the ids
        ids = (min(INPUT_IDS[0], rows - 1), min(INPUT_IDS[1], rows))
        out = {"input_ids": torch.randint(*ids, (batch, SEQ), generator=g),
               "attention_mask": torch.ones(batch, SEQ, dtype=torch.long)}
        if kind == "seq2seq":
            out["decoder_input_ids"] = torch.randint(*ids, (batch, SEQ // 2), generator=g)
    params = inspect.signature(model.forward).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return out
    return {k: v for k, v in out.items() if k in params}
