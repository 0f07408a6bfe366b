"""GPT-2-style causal Transformer decoder language model with tied embeddings.

Literature: A. Radford, J. Wu, R. Child, D. Luan, D. Amodei and I. Sutskever, "Language Models
are Unsupervised Multitask Learners" (GPT-2), OpenAI 2019: pre-LN blocks, a final LayerNorm,
learned position embeddings, GELU MLP, residual projections initialized with std
``0.02 / sqrt(2 * n_layers)``, and an output projection tied to the token embedding
(weight tying: O. Press and L. Wolf, EACL 2017). Written from scratch in plain PyTorch.

Default shapes (``vocab_size=1000``, ``d_model=64``, ``n_layers=2``, ``n_heads=4``,
``d_ff=256``, ``max_len=64``; example sequences of length 16)::

    input_ids (N, 16) int64
    token + learned position embeddings -> Dropout                       -> (N, 16, 64)
    n_layers x [x = x + CausalMHSA(LN(x)); x = x + MLP_GELU(LN(x))]      -> (N, 16, 64)
    final LayerNorm -> lm_head (weight is tok_emb.weight, no bias)       -> (N, 16, 1000) logits

Causal attention uses ``F.scaled_dot_product_attention(..., is_causal=True)``. ``lm_head.weight``
and ``tok_emb.weight`` are the same ``nn.Parameter`` (one tensor used by an embedding gather and a
GEMM). Dropout defaults to 0.0 so train-mode outputs are comparable between transformations.

Mixed-precision features exercised: tied weights shared by an embedding and a matmul, pre-LN
LayerNorms, causal softmax in SDPA, tanh-approximate GELU, large-vocabulary logits.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

VOCAB_SIZE: int = 1000
SEQ_LEN: int = 16

DEFAULT_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "max_len": 64,
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "d_ff": 256,
    "dropout": 0.0,
    "layer_norm_eps": 1e-5,
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


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention on top of ``F.scaled_dot_product_attention``."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model {d_model} must be divisible by n_heads {n_heads}")
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)
        self.attn_dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        qkv = self.qkv(x).view(n, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (N, H, T, head_dim)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.attn_dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(n, t, d)))


class MLP(nn.Module):
    """Position-wise feed-forward network with tanh-approximate GELU (as in GPT-2)."""

    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff)
        self.act = nn.GELU(approximate="tanh")
        self.proj = nn.Linear(d_ff, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))


class Block(nn.Module):
    """Pre-LN decoder block."""

    def __init__(self, d_model: int, n_heads: int, d_ff: int, dropout: float, eps: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=eps)
        self.attn = CausalSelfAttention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model, eps=eps)
        self.mlp = MLP(d_model, d_ff, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPTDecoder(nn.Module):
    """GPT-2-style language model; ``lm_head.weight is tok_emb.weight``."""

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        max_len: int = 64,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        d_ff: int = 256,
        dropout: float = 0.0,
        layer_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.max_len = max_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(max_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, d_ff, dropout, layer_norm_eps) for _ in range(n_layers)
        )
        self.ln_f = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.apply(self._init_weights)
        resid_std = 0.02 / math.sqrt(2 * n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=resid_std)
            nn.init.normal_(block.mlp.proj.weight, mean=0.0, std=resid_std)
        self.lm_head.weight = self.tok_emb.weight  # weight tying

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(N, T)`` to next-token logits ``(N, T, vocab_size)``."""
        t = input_ids.shape[1]
        if t > self.max_len:
            raise ValueError(f"sequence length {t} exceeds max_len {self.max_len}")
        pos = torch.arange(t, device=input_ids.device)
        x = self.drop(self.tok_emb(input_ids) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_model(**overrides: Any) -> nn.Module:
    """Build an fp32 GPT decoder; keyword overrides are the keys of ``DEFAULT_CONFIG``.

    ``seq_len`` only affects :func:`example_inputs` and is accepted (and ignored) here.
    """
    cfg = _config(overrides)
    for key in _INPUT_ONLY_KEYS:
        cfg.pop(key)
    return GPTDecoder(**cfg)


def example_inputs(batch_size: int = 2, *, seed: int = 0, **overrides: Any) -> tuple[torch.Tensor]:
    """Return ``(input_ids,)``, int64 of shape ``(batch_size, seq_len)``.

    Accepts the same overrides as :func:`make_model`; draws from a private generator seeded with
    ``seed``.
    """
    cfg = _config(overrides)
    seq_len = cfg["seq_len"]
    if seq_len > cfg["max_len"]:
        raise ValueError(f"seq_len {seq_len} exceeds max_len {cfg['max_len']}")
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(0, cfg["vocab_size"], (batch_size, seq_len), generator=gen),)
