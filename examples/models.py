"""Small training programs shared by the tests, the demo and the benchmarks.

Each model's ``forward`` returns the loss, so one call is one training step's
forward pass and ``loss.backward()`` its backward pass. The ``make_*``
factories return ``(model, args)`` seeded, so two calls build identical
copies (one to run eagerly, one to compile).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 2
    n_head: int = 2
    d_model: int = 64
    vocab: int = 128
    block_size: int = 32
    dropout: float = 0.0
    sdpa: bool = False      # attention through F.scaled_dot_product_attention(is_causal=True)


GPT_TINY = GPTConfig(n_layer=2, n_head=2, d_model=64, vocab=128, block_size=32)
GPT_SMALL = GPTConfig(n_layer=6, n_head=6, d_model=384, vocab=512, block_size=64)
GPT_SDPA = GPTConfig(n_layer=4, n_head=4, d_model=64, vocab=128, block_size=32, sdpa=True)   # the benchmarks' GPT


class CausalSelfAttention(nn.Module):
    """Attention from plain ops (no fused SDPA) so the captured graph shows
    every matmul, mask and softmax the backward pass has to differentiate."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.sdpa = cfg.sdpa
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.attn_drop = nn.Dropout(cfg.dropout)
        self.resid_drop = nn.Dropout(cfg.dropout)
        # A buffer, not a parameter: captured as a non-trainable graph input.
        mask = torch.tril(torch.ones(cfg.block_size, cfg.block_size, dtype=torch.bool))
        self.register_buffer("mask", mask.view(1, 1, cfg.block_size, cfg.block_size))

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0,
                                               is_causal=True)
            return self.resid_drop(self.proj(y.transpose(1, 2).contiguous().view(b, t, c)))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = self.attn_drop(F.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model), nn.Dropout(cfg.dropout))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab, cfg.d_model)
        self.pos_emb = nn.Parameter(torch.zeros(1, cfg.block_size, cfg.d_model))
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)
        # Tied: one parameter reached by two names, so its gradient is the
        # sum of two uses and must be reported once.
        self.lm_head.weight = self.tok_emb.weight
        # GPT-2 style small init keeps the initial loss near log(vocab).
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx, targets):
        t = idx.size(1)
        x = self.drop(self.tok_emb(idx) + self.pos_emb[:, :t])
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class CNN(nn.Module):
    """Conv/BatchNorm classifier for 1x16x16 images; in train mode BatchNorm
    updates its running stats in place (buffer mutations)."""

    def __init__(self, n_classes: int = 10, dropout: float = 0.25):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2))
        self.head = nn.Sequential(nn.Flatten(), nn.Dropout(dropout), nn.Linear(16 * 4 * 4, n_classes))

    def forward(self, x, y):
        return F.cross_entropy(self.head(self.features(x)), y)


class MLP(nn.Module):
    """Many tiny layers: the run time is almost all per-op and per-call overhead."""

    def __init__(self, width: int = 32, depth: int = 8):
        super().__init__()
        layers = []
        for i in range(depth):
            layers.append(nn.Linear(width, width))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x, y):
        return F.mse_loss(self.net(x), y)


def gpt_batch(cfg: GPTConfig, batch: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(cfg.vocab, (batch, cfg.block_size), generator=g)
    targets = torch.randint(cfg.vocab, (batch, cfg.block_size), generator=g)
    return idx, targets


def make_gpt(cfg: GPTConfig = GPT_TINY, batch: int = 4, seed: int = 0):
    torch.manual_seed(seed)
    return GPT(cfg).train(), gpt_batch(cfg, batch, seed)


def make_gpt_tiny(batch: int = 4, seed: int = 0, dropout: float = 0.0):
    return make_gpt(replace(GPT_TINY, dropout=dropout), batch, seed)


def make_gpt_small(batch: int = 4, seed: int = 0):
    return make_gpt(GPT_SMALL, batch, seed)


def make_gpt_sdpa(batch: int = 4, seed: int = 0):
    """4 layers, fused causal attention: the GPT ``benchmarks.recompile`` times warm starts on."""
    return make_gpt(GPT_SDPA, batch, seed)


def cnn_batch(batch: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 1, 16, 16, generator=g), torch.randint(10, (batch,), generator=g)


def make_cnn(batch: int = 8, seed: int = 0, dropout: float = 0.25):
    torch.manual_seed(seed)
    return CNN(dropout=dropout).train(), cnn_batch(batch, seed)


def make_mlp(batch: int = 8, width: int = 32, depth: int = 8, seed: int = 0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, width, generator=g)
    y = torch.randn(batch, width, generator=g)
    return MLP(width, depth).train(), (x, y)
