"""Models whose tokens mix outside ``F.scaled_dot_product_attention``, written as users write them for one
device: torch's own attention modules, a per-head attention bias, a hybrid of linear attention and short
convolutions, pooling heads for classification and reward models. The SP pass makes each exact by
redistribution (Note [Redistribution] in ``compiler/prove/analysis.py``).

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


class HeadsLM(_SGD):
    """Layers of multi-head attention on q, k, v projections, each added back through a projection;
    subclasses say how heads attend (``attend``)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        B, T = ids.shape
        x = self.embed(ids)
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            x = x + proj(self.attend(q, k, v).transpose(1, 2).reshape(B, T, -1))  # (B, H, T, hs) in
        return causal_lm_loss(self.head(x), ids)


class AlibiGPT(HeadsLM):
    """SDPA with ALiBi as a per-head float mask ``[H, T, T]`` (linear distance penalties, causal)."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__(dim, heads, layers)
        self.register_buffer("slopes", alibi_slopes(heads), persistent=False)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(q.size(-2), device=q.device)
        distance = (positions[None, :] - positions[:, None]).float()  # (T, T): key - query
        bias = self.slopes[:, None, None] * distance  # (H, T, T)
        bias = bias.masked_fill(distance > 0, float("-inf"))
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


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
        # contiguous: under torch.compile (torch 2.13, CPU) cumsum's backward of a transposed view meets a
        # view of incompatible strides, with or without sequence parallelism
        return t.view(B, T, self.heads, -1).transpose(1, 2).contiguous()  # (B, H, T, hs)

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


class WrittenAttentionGPT(HeadsLM):
    """Multi-head causal attention written out (``softmax(q k^T / sqrt(d)) v`` with a ``tril`` mask)."""

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return scaled_dot_product(q, k, v)


class CheckpointedGPT(_SGD):
    """The tests' GPT with every block under ``torch.utils.checkpoint`` (non-reentrant), as long-context
    fine-tuning turns on first; SAC replaces it (``compiler/prove/normalize.py``)."""

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


class ScaledTanhGelu(torch.autograd.Function):
    """An elementwise activation with a hand-written backward, as Bloom's ``GeLUFunction``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        tanh = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        slope = 0.5 * x * ((1 - tanh * tanh) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + tanh)
        return slope * grad


class MetaLlamaBlockLM(_SGD):
    """Idioms of Meta's reference Llama code: rotary embeddings as complex numbers (``view_as_complex`` of
    q and k times ``freqs_cis[:seqlen]``), keys built in place into a ``new_empty`` buffer through views
    (``copy_``, as DeepSeek's MLA does), and an activation with a custom ``autograd.Function``."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.wq, self.wk, self.wv = (nn.Linear(dim, dim) for _ in range(3))
        self.wo = nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.head = nn.Linear(dim, VOCAB)
        head_dim = dim // heads
        angles = torch.outer(
            torch.arange(128).float(), 1.0 / 10000 ** (torch.arange(0, head_dim, 2) / head_dim)
        )
        self.register_buffer("freqs_cis", torch.polar(torch.ones_like(angles), angles), persistent=False)

    def rotate(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))  # (B, T, H, hs/2)
        return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3).type_as(x)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        B, T = ids.shape
        x = self.embed(ids)
        freqs = self.freqs_cis[:T]
        q, k, v = (w(x).view(B, T, self.heads, -1) for w in (self.wq, self.wk, self.wv))
        q, k_rot = self.rotate(q, freqs), self.rotate(k, freqs)
        keys = k.new_empty(B, T, self.heads, 2 * k.size(-1))  # keys: rotated half, then the raw half
        keys[..., : k.size(-1)].copy_(k_rot)
        keys[..., k.size(-1) :].copy_(k)
        q = torch.cat([q, torch.zeros_like(q)], dim=-1)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys.transpose(1, 2), torch.cat([v, v], dim=-1).transpose(1, 2), is_causal=True
        )
        x = x + self.wo(y.transpose(1, 2)[..., : k.size(-1)].reshape(B, T, -1))
        x = x + self.down(ScaledTanhGelu.apply(self.up(x)))
        return causal_lm_loss(self.head(x), ids)


class CapacityMoELM(_SGD):
    """A mixture of experts that drops tokens past each expert's capacity: the slot of a token within its
    expert is a running count over tokens, which depends on the other tokens of the batch. Sharded, each
    rank would count its own tokens only, so the pass refuses it."""

    def __init__(self, dim: int = 32, experts: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.router = nn.Linear(dim, experts)
        self.experts = nn.Parameter(0.02 * torch.randn(experts, dim, dim))
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        x = self.embed(ids)
        tokens = x.reshape(-1, x.size(-1))
        choice = F.one_hot(self.router(tokens).argmax(-1), self.experts.size(0))  # (N, E)
        slot = choice.cumsum(0) * choice  # 1-based position of each token within its expert
        kept = (slot <= 8) & (slot > 0)
        out = torch.einsum("ne,edf,nd->nf", kept.float(), self.experts, tokens)
        return causal_lm_loss(self.head(x + out.view_as(x)), ids)


class ConvolutionLM(_SGD):
    """Full (not grouped) convolutions over the sequence, as text and audio models write them: ``kind``
    picks one. ``same``: kernel 3, padding 1; ``same_even``: ``padding="same"`` with kernel 4 (one more
    zero after than before); ``dilated``: kernel 3, dilation 4, padding 4; ``causal``: padding k - 1 then
    the first T outputs; ``valid``: no padding, the loss on the T - 2 outputs; ``spectrogram``: a 3x3
    ``Conv2d`` over [B, 1, T, C], time along the sequence; ``wide``: kernel 3, dilation 8, padding 8 (a
    window reaching past a short neighbour's shard); ``strided``: stride 2 (refused). Then causal attention
    over the convolution's output positions."""

    def __init__(self, kind: str, dim: int = 16) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(VOCAB, dim)
        if kind == "spectrogram":
            self.conv = nn.Conv2d(1, 2, 3, padding=1)
            self.mix = nn.Linear(2 * dim, dim)
        else:
            options = {
                "same": {"kernel_size": 3, "padding": 1},
                "same_even": {"kernel_size": 4, "padding": "same"},
                "dilated": {"kernel_size": 3, "dilation": 4, "padding": 4},
                "causal": {"kernel_size": 3, "padding": 2},
                "valid": {"kernel_size": 3},
                "wide": {"kernel_size": 3, "dilation": 8, "padding": 8},
                "strided": {"kernel_size": 3, "stride": 2, "padding": 1},
            }[kind]
            self.conv = nn.Conv1d(dim, dim, **options)
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        B, T = ids.shape
        x = self.embed(ids)
        if self.kind == "spectrogram":
            y = F.gelu(self.conv(x.unsqueeze(1)))  # (B, 2, T, C)
            x = x + self.mix(y.permute(0, 2, 1, 3).reshape(B, T, -1))
        else:
            y = F.gelu(self.conv(x.transpose(1, 2)))
            if self.kind == "causal":
                y = y[..., :T]
            x = y.transpose(1, 2) if self.kind in ("valid", "strided") else x + y.transpose(1, 2)
        # attention over the convolution's positions (T - 2 of them for "valid")
        heads = x.view(B, x.size(1), 4, -1).transpose(1, 2)
        x = x + F.scaled_dot_product_attention(heads, heads, heads, is_causal=True).transpose(1, 2).flatten(2)
        logits = self.head(x)
        if self.kind == "strided":  # half the positions: a mean over them
            return logits.logsumexp(-1).mean()
        if self.kind == "valid":  # output t reads inputs t .. t + 2: it predicts token t + 3
            return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 3:].reshape(-1))
        return causal_lm_loss(logits, ids)


class JoinedTokensLM(_SGD):
    """Learned tokens joined to the sequence: two register tokens before it and a summary token after it
    (``torch.cat`` along the sequence), learned positions for all of them, causal attention over the
    joined sequence, and the LM loss on the sequence's own positions."""

    def __init__(self, dim: int = 32, heads: int = 4, before: int = 2, after: int = 1) -> None:
        super().__init__()
        self.heads, self.before, self.after = heads, before, after
        self.embed = nn.Embedding(VOCAB, dim)
        self.registers = nn.Parameter(torch.randn(1, before, dim) * 0.1)
        self.summary = nn.Parameter(torch.randn(1, after, dim) * 0.1)
        self.positions = nn.Embedding(64, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        B = ids.size(0)
        x = self.embed(ids)
        x = torch.cat([self.registers.expand(B, -1, -1), x, self.summary.expand(B, -1, -1)], dim=1)
        T = x.size(1)
        x = x + self.positions(torch.arange(T, device=ids.device))
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(y.transpose(1, 2).reshape(B, T, -1))
        return causal_lm_loss(self.head(x[:, self.before : T - self.after]), ids)
