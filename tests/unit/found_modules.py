"""Minimal modules of defects and needless refusals found outside the suite (issue 48), each shrunk to the
idiom that showed it. tests/unit/test_found.py checks each against one device."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.associative_scan import associative_scan

from tests.distributed.modules import VOCAB


class CausalBlock(nn.Module):
    """One causal SDPA attention block, as the fuzzer's modules write it (heads from a fused projection)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in self.qkv(x).split(C, 2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class LengthAsFloat(nn.Module):
    """A pooled head that divides by the length as a float: ``1.0 / T``, ``float(T)``, ``math.sqrt(T)``
    are SymFloats in Dynamo's graph, which the pass took for this rank's count (silently wrong before)."""

    def __init__(self, spelling: str) -> None:
        super().__init__()
        self.spelling = spelling
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 3)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = torch.tanh(self.mix(self.embed(batch["input_ids"])))
        length = x.size(1)
        if self.spelling == "reciprocal":
            pooled = x.sum(1) * (1.0 / length)
        elif self.spelling == "float":
            pooled = x.sum(1) / float(length)
        else:  # scaled twice by 1/sqrt(T), as attention-style scaling does
            pooled = (x / math.sqrt(length)).sum(1) / math.sqrt(length)
        return F.cross_entropy(self.head(pooled), batch["cls"])


class PairwiseReward(nn.Module):
    """A reward model's pairwise loss (DPO and its kin): ``-logsigmoid(chosen - rejected)`` over
    mean-pooled scores, and TRL's masked label write ``labels[labels == -100] = 0`` before a gather."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.mix = nn.Linear(16, 16)
        # No bias: a pairwise loss cancels it, so its gradient is zero in exact arithmetic and only rounding
        # is left to compare (against the floor of the suite's gradient error).
        self.score = nn.Linear(16, 1, bias=False)
        self.lm_head = nn.Linear(16, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        hidden = torch.tanh(self.mix(self.embed(batch["input_ids"])))
        rewards = self.score(hidden).squeeze(-1).mean(dim=1)
        chosen, rejected = rewards[0::2], rewards[1::2]
        labels = batch["labels"].clone()
        kept = labels != -100
        labels[labels == -100] = 0
        log_probs = torch.log_softmax(self.lm_head(hidden), dim=-1)
        token_log_probs = torch.gather(log_probs, 2, labels.unsqueeze(-1)).squeeze(-1)
        nll = -(token_log_probs * kept).sum() / kept.sum()
        return -F.logsigmoid(chosen - rejected).mean() + nll


class TorchEncoder(nn.Module):
    """``nn.TransformerEncoder(batch_first=True)``: its multi-head attention views (S, 1, E) as
    (S, 1, heads, E / heads) at batch size 1, which the pass refused as mixing the sequence dim."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(32, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        hidden = self.encoder(self.embed(batch["input_ids"]))
        return F.cross_entropy(self.head(hidden).flatten(0, 1), batch["input_ids"].flatten())


class MixtralRouterLoss(nn.Module):
    """Mixtral from its default config (sizes only) with ``output_router_logits=True``: the load-balancing
    loss counts tokens per expert with ``histc`` and divides by ``0.0 + rows`` (a float length)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import MixtralConfig, MixtralForCausalLM

        config = MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            output_router_logits=True,
        )
        self.model = MixtralForCausalLM(config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


class PooledAttention(nn.Module):
    """One causal attention block pooled over the sequence, found by the fuzzer (benchmarks/fuzz.py):
    ``"max"`` (seed 100013) trained silently 1/P off (the maximum's gradient reached only its holder's
    copy of the loss); ``"last"`` (seed 100004), the last position's logits in a pairwise loss at 3 ranks,
    recursed forever in the analysis (the position is one rank's, then a block of channels with no token
    left in it, which now goes whole by an all-gather)."""

    def __init__(self, pooling: str, heads: int = 12, dim: int = 24) -> None:
        super().__init__()
        self.pooling = pooling
        self.embed = nn.Embedding(VOCAB, dim)
        self.block = CausalBlock(dim, heads)
        self.head = nn.Linear(dim, 3 if pooling == "max" else 2)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.block(self.embed(batch["input_ids"]))
        if self.pooling == "max":
            return F.cross_entropy(self.head(x.max(dim=1).values), batch["cls"])
        logits = self.head(x[:, -1:].squeeze(1))
        return -F.logsigmoid(logits[:, 0] - logits[:, 1]).mean()


class StepIdioms(nn.Module):
    """Idioms the fuzzer found refused although exact layouts exist: rotary angles computed in the step
    (``torch.outer(arange(T), inv_freq)``), a running mean over ``arange(1, T + 1)``, a mean pooled with
    ``keepdim`` and squeezed, the last position sliced ``x[:, -1:]`` into a classifier."""

    def __init__(self, idiom: str, heads: int = 4, dim: int = 16) -> None:
        super().__init__()
        self.idiom = idiom
        self.embed = nn.Embedding(VOCAB, dim)
        self.block = CausalBlock(dim, heads)
        self.head = nn.Linear(dim, 3)
        half = dim // heads // 2
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(half).float() / half), persistent=False)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        T, C = x.shape[1:]
        if self.idiom == "rotary_in_step":
            angles = torch.outer(torch.arange(T, dtype=torch.float32), self.inv_freq)
            x = x + torch.cat([angles.cos(), angles.sin()] * (C // (2 * angles.shape[1])), dim=-1)
        elif self.idiom == "running_mean":
            x = x.cumsum(1) / torch.arange(1, T + 1)[None, :, None]
        x = self.block(x)
        if self.idiom == "last_slice":
            pooled = x[:, -1:].squeeze(1)
        else:
            pooled = x.mean(1, keepdim=True).squeeze(1)
        return F.cross_entropy(self.head(pooled), batch["cls"])


class FlippedMaskedMean(nn.Module):
    """A reversed mixer (``x + linear(x).flip(1)``) pooled by a mean masked with the batch's
    ``attention_mask``, found by the fuzzer (seed 202606210): the whole-sequence mask was gathered before
    the size it needs (a shard length in the length symbol) was computed, and the graph failed to lint."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        return self.masked_mean_loss(x + self.mix(x).flip(1), batch)

    def masked_mean_loss(self, x: torch.Tensor, batch: dict) -> torch.Tensor:
        keep = batch["attention_mask"].unsqueeze(-1).to(x.dtype)
        pooled = (x * keep).sum(dim=1) / keep.sum(dim=1)
        return F.cross_entropy(self.head(pooled), batch["cls"])


class FeaturesThenMaskedAttention(nn.Module):
    """Features at placeholder tokens, then attention under a boolean causal mask built from the length
    (fuzz seed 120603627, shrunk). The mask's whole-sequence copy reads the length symbols only, and it
    was put after them, above the graph's tensor inputs, so the gather of the token ids that followed
    it came before the ids it gathers: a crash, not a refusal."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(VOCAB, dim)
        self.features = nn.Linear(12, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        B, T = ids.shape
        x = self.embed(ids)
        features = torch.tanh(self.features(batch["pixels"]))
        x = x.masked_scatter((ids == VOCAB - 1).unsqueeze(-1).expand_as(x), features)
        q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        allowed = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + y.transpose(1, 2).reshape(B, T, -1)
        return F.cross_entropy(self.head(x).flatten(0, 1), batch["labels"].flatten())


class TwoScansPooled(nn.Module):
    """Two of torch's associative scans along the sequence, then a masked mean (fuzz seed 2026181483624,
    shrunk). At sp=3 with batch 3 the scans run on the whole sequence for one sample per rank; the second
    scan's odd-length halves end at a size no guard proves is the length, so the head's input came back
    gathered whole and was multiplied with this rank's mask: a crash (23 rows against 8). Now exact, the
    size read as the length it equals in a graph compiled for that length only."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 3)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        h = self.embed(batch["input_ids"])
        for _ in range(2):
            gates = (torch.sigmoid(self.mix(h)), h)
            h = associative_scan(
                lambda left, right: (left[0] * right[0], right[0] * left[1] + right[1]),
                gates,
                dim=1,
                combine_mode="generic",
            )[1]
        keep = batch["attention_mask"].unsqueeze(-1).to(h.dtype)
        return F.cross_entropy((self.head(h) * keep).sum(1) / keep.sum(1), batch["cls"])


class SectionsAfterAScan(FlippedMaskedMean):
    """A suffix sum over the sequence (run whole, split over channels), a residual, then rotary-style sections
    written into a copy along the hidden dim (fuzz seed 2026181483639, shrunk). The residual add met a
    split value and a sequence shard of the same size and kept the stream split, so the assignment's
    target was split along the very dim it indexes: refused. On a tie the split side now goes back to
    sequence shards, and the assignment writes each token's row on its own rank."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__(dim)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        x = self.embed(batch["input_ids"])
        T = x.shape[1]
        x = x + self.mix(x).flip(1).cumsum(dim=1).flip(1) / T
        x = x.clone()
        x[..., 1::3] = torch.tanh(x[..., 1::3])
        return self.masked_mean_loss(x, batch)
