"""BERT-style bidirectional Transformer encoder with a sequence-classification head.

Literature: J. Devlin, M.-W. Chang, K. Lee and K. Toutanova, "BERT: Pre-training of Deep
Bidirectional Transformers for Language Understanding", NAACL 2019; the encoder layer is the
post-LN Transformer of A. Vaswani et al., "Attention Is All You Need", NeurIPS 2017.
Written from scratch in plain PyTorch (no ``transformers`` dependency).

Default shapes (``vocab_size=1000``, ``d_model=64``, ``n_layers=2``, ``n_heads=4``,
``d_ff=256``, ``max_len=64``; example sequences of length 16)::

    input_ids (N, 16) int64, attention_mask (N, 16) int64 (1 = token, 0 = padding)
    token + learned position embeddings -> LayerNorm -> Dropout        -> (N, 16, 64)
    n_layers x [x = LN(x + MHSA(x, mask)); x = LN(x + FFN_GELU(x))]    -> (N, 16, 64)
    pooler tanh(Linear(h[:, 0])) -> Dropout -> Linear(64->num_labels)  -> (N, 2) logits

Self-attention uses ``torch.nn.functional.scaled_dot_product_attention``. The padding mask is
applied either as the original BERT additive bias ``(1 - mask) * -10000.0`` (``mask_mode=
"additive"``, default; finite in fp16/bf16) or as a boolean mask (``mask_mode="bool"``). As in
BERT, LayerNorm eps is 1e-12 (below fp16's smallest subnormal, so LayerNorm must stay in fp32)
and weights are initialized N(0, 0.02). Segment (token-type) embeddings are omitted. Dropout
defaults to 0.0 so train-mode outputs are comparable between graph transformations.

Mixed-precision features exercised: embeddings, LayerNorm with tiny eps, softmax inside SDPA
with an additive/boolean mask, GELU FFN GEMMs, residual adds, tanh pooler.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

NUM_LABELS: int = 2
VOCAB_SIZE: int = 1000
SEQ_LEN: int = 16
PAD_TOKEN_ID: int = 0

DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "max_len": 64,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "d_ff": 256,
    "num_labels": NUM_LABELS,
    "dropout": 0.0,
    "layer_norm_eps": 1e-12,
    "mask_mode": "additive",
    "seq_len": SEQ_LEN,
}
# Keys that only shape example_inputs, not the model.
_INPUT_ONLY_KEYS = ("seq_len",)


def _config(overrides: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(overrides) - set(DEFAULT_CONFIG))
    if unknown:
        raise TypeError(
            f"unknown option(s) {unknown}; expected a subset of {sorted(DEFAULT_CONFIG)}"
        )
    return {**DEFAULT_CONFIG, **overrides}


class SelfAttention(nn.Module):
    """Multi-head self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model {d_model} must be divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.attn_dropout = dropout

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        n, t, d = x.shape
        qkv = self.qkv(x).view(n, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (N, H, T, head_dim)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=self.attn_dropout if self.training else 0.0
        )
        return self.out(y.transpose(1, 2).reshape(n, t, d))


class EncoderLayer(nn.Module):
    """Post-LN Transformer encoder layer (attention and GELU feed-forward sublayers)."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.attn = SelfAttention(d_model, n_heads, dropout)
        self.drop1 = nn.Dropout(dropout)
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.ff = nn.Sequential(
            nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model), nn.Dropout(dropout)
        )
        self.ln2 = nn.LayerNorm(d_model, eps=eps)

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor | None) -> torch.Tensor:
        x = self.ln1(x + self.drop1(self.attn(x, attn_mask)))
        return self.ln2(x + self.ff(x))


class BertEncoder(nn.Module):
    """BERT encoder with a [CLS]-position pooler and a linear classification head."""

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        max_len: int = 64,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        d_ff: int = 256,
        num_labels: int = NUM_LABELS,
        dropout: float = 0.0,
        layer_norm_eps: float = 1e-12,
        mask_mode: str = "additive",
    ) -> None:
        super().__init__()
        if mask_mode not in ("additive", "bool"):
            raise ValueError(f"mask_mode must be 'additive' or 'bool', got {mask_mode!r}")
        self.mask_mode = mask_mode
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.emb_ln = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.emb_drop = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            EncoderLayer(d_model, n_heads, d_ff, dropout, layer_norm_eps) for _ in range(n_layers)
        )
        self.pooler = nn.Linear(d_model, d_model)
        self.pool_drop = nn.Dropout(dropout)
        self.classifier = nn.Linear(d_model, num_labels)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def _attn_mask(
        self, attention_mask: torch.Tensor | None, dtype: torch.dtype
    ) -> torch.Tensor | None:
        if attention_mask is None:
            return None
        keep = attention_mask[:, None, None, :]  # (N, 1, 1, T), broadcast over heads and queries
        if self.mask_mode == "bool":
            return keep != 0
        return (1.0 - keep.to(dtype)) * -10000.0

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Map token ids ``(N, T)`` and an optional 1/0 padding mask to ``(N, num_labels)``."""
        t = input_ids.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len {self.max_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.emb_drop(self.emb_ln(self.tok_emb(input_ids) + self.pos_emb(pos)))
        mask = self._attn_mask(attention_mask, x.dtype)
        for layer in self.layers:
            x = layer(x, mask)
        pooled = torch.tanh(self.pooler(x[:, 0]))
        return self.classifier(self.pool_drop(pooled))


def make_model(**overrides: Any) -> nn.Module:
    """Build an fp32 BERT encoder; keyword overrides are the keys of ``DEFAULT_CONFIG``.

    ``seq_len`` only affects :func:`example_inputs` and is accepted (and ignored) here.
    """
    cfg = _config(overrides)
    for key in _INPUT_ONLY_KEYS:
        cfg.pop(key)
    return BertEncoder(**cfg)


def example_inputs(
    batch_size: int = 2, *, seed: int = 0, **overrides: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(input_ids, attention_mask)``, both int64 of shape ``(batch_size, seq_len)``.

    Every odd-indexed sequence (the second, fourth, ...) is right-padded: its last
    ``seq_len // 4`` positions hold ``PAD_TOKEN_ID`` and have mask 0. Position 0 is never padded.
    Accepts the same overrides as :func:`make_model`; draws from a private generator.
    """
    cfg = _config(overrides)
    seq_len = cfg["seq_len"]
    if seq_len > cfg["max_len"]:
        raise ValueError(f"seq_len {seq_len} exceeds max_len {cfg['max_len']}")
    gen = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, cfg["vocab_size"], (batch_size, seq_len), generator=gen)
    attention_mask = torch.ones(batch_size, seq_len, dtype=torch.int64)
    n_pad = min(seq_len // 4, seq_len - 1)
    if n_pad > 0:
        attention_mask[1::2, seq_len - n_pad :] = 0
        input_ids[1::2, seq_len - n_pad :] = PAD_TOKEN_ID
    return input_ids, attention_mask
