"""Models whose tokens mix outside ``F.scaled_dot_product_attention``, written as users write them for one
device: torch's own attention modules, a per-head attention bias, a hybrid of linear attention and short
convolutions, pooling heads for classification and reward models. The SP pass makes each exact by
redistribution (Note [Redistribution] in ``compiler/analysis.py``).

Tiny: hidden 32, 4 heads, ``VOCAB`` tokens, every dropout 0; seeded by the caller.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.modules import VOCAB
from tests.distributed.user_modules import _SGD


def causal_lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))


class MultiheadAttentionLM(_SGD):
    """``nn.MultiheadAttention`` blocks with a causal mask, called as its docs show (``need_weights`` left
    at its default: the averaged weights come back, unused)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.attns = nn.ModuleList(nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        x = self.embed(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1), device=ids.device)
        for norm, attn in zip(self.norms, self.attns):
            h = norm(x)
            out, _ = attn(h, h, h, attn_mask=mask)
            x = x + out
        return causal_lm_loss(self.head(x), ids)


class TransformerEncoderLM(_SGD):
    """``nn.TransformerEncoder(..., is_causal=True)``, the decoder-only LM of PyTorch's tutorials."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        mask = nn.Transformer.generate_square_subsequent_mask(ids.size(1), device=ids.device)
        x = self.encoder(self.embed(ids), mask=mask, is_causal=True)
        return causal_lm_loss(self.head(x), ids)


def alibi_slopes(heads: int) -> torch.Tensor:
    return torch.tensor([2 ** (-8 * (h + 1) / heads) for h in range(heads)])


class AlibiGPT(_SGD):
    """SDPA with ALiBi as a per-head float mask ``[H, T, T]`` (linear distance penalties, causal)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)
        self.register_buffer("slopes", alibi_slopes(heads), persistent=False)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        B, T = ids.shape
        positions = torch.arange(T, device=ids.device)
        distance = (positions[None, :] - positions[:, None]).float()  # (T, T): key - query
        bias = self.slopes[:, None, None] * distance  # (H, T, T)
        bias = bias.masked_fill(distance > 0, float("-inf"))
        x = self.embed(ids)
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # (B, H, T, hs)
            x = x + proj(y.transpose(1, 2).reshape(B, T, -1))
        return causal_lm_loss(self.head(x), ids)


class HybridLM(_SGD):
    """A hybrid of the kind recent long-context models use: a short causal depthwise convolution and
    causal linear attention (a running sum of k v^T per head, read by q: ``einsum`` and ``cumsum``)
    in one layer, SDPA in the next."""

    def __init__(self, dim: int = 32, heads: int = 4, kernel: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, padding=kernel - 1)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(2))
        self.out = nn.ModuleList(nn.Linear(dim, dim) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def split_heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, self.heads, -1).transpose(1, 2)  # (B, H, T, hs)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        B, T = ids.shape
        x = self.embed(ids)
        x = x + self.conv(x.transpose(1, 2))[..., :T].transpose(1, 2)  # causal short convolution
        q, k, v = (self.split_heads(t) for t in self.qkv[0](x).chunk(3, dim=-1))
        q, k = F.elu(q) + 1, F.elu(k) + 1
        state = torch.einsum("bhtd,bhte->bhtde", k, v).cumsum(dim=2)  # (B, H, T, hs, hs)
        norm = k.cumsum(dim=2)  # (B, H, T, hs)
        y = torch.einsum("bhtd,bhtde->bhte", q, state) / (q * norm).sum(-1, keepdim=True)
        x = x + self.out[0](y.transpose(1, 2).reshape(B, T, -1))
        q, k, v = (self.split_heads(t) for t in self.qkv[1](self.norm(x)).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out[1](y.transpose(1, 2).reshape(B, T, -1))
        return causal_lm_loss(self.head(x), ids)


class PooledClassifier(_SGD):
    """A sequence classifier (or, with one output, a reward model) on a transformer encoder: ``pool="mean"``
    averages the tokens, ``pool="last"`` takes the last token's state; cross-entropy against
    ``batch["label"]`` (mean-squared error for one output)."""

    def __init__(self, pool: str = "mean", classes: int = 3, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.pool, self.classes = pool, classes
        self.embed = nn.Embedding(VOCAB, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1)
        self.score = nn.Sequential(nn.Linear(dim, dim), nn.Tanh(), nn.Linear(dim, classes))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.encoder(self.embed(batch["input_ids"]))
        pooled = x.mean(dim=1) if self.pool == "mean" else x[:, -1]
        scores = self.score(pooled)
        labels = batch["label"]
        if self.classes == 1:
            return F.mse_loss(scores.squeeze(-1), labels.float())
        return F.cross_entropy(scores, labels)


def scaled_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Attention written out, as many hand-written models do (causal, scaled)."""
    T = q.size(-2)
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v


class WrittenAttentionGPT(_SGD):
    """Multi-head causal attention written out (``softmax(q k^T / sqrt(d)) v`` with a ``tril`` mask)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        B, T = ids.shape
        x = self.embed(ids)
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            x = x + proj(scaled_dot_product(q, k, v).transpose(1, 2).reshape(B, T, -1))
        return causal_lm_loss(self.head(x), ids)


class CheckpointedGPT(_SGD):
    """The tests' GPT with every block under ``torch.utils.checkpoint`` (non-reentrant), as long-context
    fine-tuning turns on first; SAC replaces it (``compiler/normalize.py``)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        from tests.distributed.modules import TinyGPT

        self.model = TinyGPT(dim=dim, heads=heads, layers=layers)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        ids = batch["input_ids"]
        model = self.model
        x = model.wte(ids) + model.wpe(torch.arange(ids.size(1), device=ids.device))
        for index in range(len(model.attns)):
            x = checkpoint(model.layer, index, x, use_reentrant=False)
        return causal_lm_loss(model.head(x), ids)
