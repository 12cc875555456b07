"""A causal Transformer language model (pre-norm, learned positions, tied embeddings)."""
from __future__ import annotations

import torch
from torch import nn


class TransformerLM(nn.Module):
    """Decoder-only Transformer: token + position embeddings, ``layers`` pre-norm blocks, tied output head."""

    def __init__(self, vocab_size: int = 256, d_model: int = 512, layers: int = 6, heads: int = 8,
                 ff_mult: int = 4, max_len: int = 512, dropout: float = 0.1) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"TransformerLM: d_model ({d_model}) must be divisible by heads ({heads})")
        self.max_len = max_len
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(max_len, d_model)
        block = nn.TransformerEncoderLayer(d_model, heads, ff_mult * d_model, dropout, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        if t > self.max_len:
            raise ValueError(f"TransformerLM: sequence length {t} exceeds max_len={self.max_len}")
        x = self.tok(tokens) + self.pos(torch.arange(t, device=tokens.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=tokens.device, dtype=x.dtype)
        return self.head(self.norm(self.blocks(x, mask=mask, is_causal=True)))
