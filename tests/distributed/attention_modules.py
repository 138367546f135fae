"""Tiny LightningModules for packed documents and flash-attn, written as for one device.

Packed rows come with ``position_ids`` that restart at every document (and, for the varlen
flash-attn model, ``cu_seqlens`` of the whole row), as a packing collate function would make them.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from tests.distributed.modules import VOCAB, LlamaModule
from tests.flash_stand_in import flash_attn_func, flash_attn_varlen_func


def packed_inputs(documents: tuple[int, ...]) -> dict[str, torch.Tensor]:
    """``position_ids`` restarting at each document and flash-attn's ``cu_seqlens`` (int32) for one row."""
    starts = torch.tensor([0, *documents]).cumsum(0)
    return {
        "position_ids": torch.cat([torch.arange(length) for length in documents]),
        "cu_seqlens": starts.to(torch.int32),
    }


def causal_mask(batch_size: int, length: int) -> torch.Tensor:
    return torch.ones(length, length, dtype=torch.bool).tril().expand(batch_size, 1, length, length)


class PackedLlamaModule(LlamaModule):
    """HF Llama given ``position_ids``: HF builds the document mask from them (transformers 5), but only
    without a cache (``masking_utils.create_causal_mask``), so a step on packed rows passes
    ``use_cache=False`` as HF users packing documents do."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        return self.model(input_ids=ids, position_ids=batch["position_ids"], labels=ids, use_cache=False).loss

    @torch.no_grad()
    def cross_document_loss(self, batch: dict) -> float:
        """The same positions with attention across documents (a plain causal mask): the negative control."""
        ids = batch["input_ids"]
        mask = causal_mask(*ids.shape)  # a 4-D mask is used as it is
        return self.model(
            input_ids=ids, position_ids=batch["position_ids"], attention_mask=mask, labels=ids
        ).loss.item()


class PaddedLlamaModule(LlamaModule):
    """HF Llama given a padding ``attention_mask`` [B, S] (1 = token, 0 = padding)."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids, keep = batch["input_ids"], batch["attention_mask"]
        return self.model(input_ids=ids, attention_mask=keep, labels=ids.masked_fill(keep == 0, -100)).loss


class DocumentMaskGPT(nn.Module):
    """Learned positions from ``position_ids``; SDPA with a block-diagonal causal mask from them."""

    def __init__(self, dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(256, dim)
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(
        self, ids: torch.Tensor, position_ids: torch.Tensor, cross_documents: bool = False
    ) -> torch.Tensor:
        B, T = ids.shape  # batch, sequence
        x = self.wte(ids) + self.wpe(position_ids)
        documents = (position_ids == 0).cumsum(-1)  # (B, T): which document each token is in
        same_document = documents[:, :, None] == documents[:, None, :]  # (B, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        allowed = causal.expand(B, T, T) if cross_documents else same_document & causal
        mask = allowed[:, None]  # (B, 1, T, T)
        for qkv, proj in zip(self.qkv, self.proj):
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in qkv(x).chunk(3, dim=-1))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, nh, T, hs)
            x = x + proj(y.transpose(1, 2).reshape(B, T, -1))
        return self.head(x)


class DocumentMaskGPTModule(L.LightningModule):
    def __init__(self, **model_kwargs) -> None:
        super().__init__()
        self.model = DocumentMaskGPT(**model_kwargs)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.model(ids, batch["position_ids"])
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    @torch.no_grad()
    def cross_document_loss(self, batch: dict) -> float:
        ids = batch["input_ids"]
        logits = self.model(ids, batch["position_ids"], cross_documents=True)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)).item()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class FlashGPT(nn.Module):
    """flash-attn on [B, S, H, D]; ``varlen=True``: one packed row, documents at ``cu_seqlens``."""

    def __init__(
        self,
        dim: int = 32,
        heads: int = 4,
        kv_heads: int = 2,
        layers: int = 2,
        window: int = -1,
        softcap: float = 0.0,
        varlen: bool = False,
    ) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, dim // heads
        self.window, self.softcap, self.varlen = window, softcap, varlen
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(256, dim)
        self.q = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.kv = nn.ModuleList(nn.Linear(dim, 2 * kv_heads * self.head_dim) for _ in range(layers))
        self.proj = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def forward(
        self, ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor | None = None
    ) -> torch.Tensor:
        B, T = ids.shape  # batch, sequence
        x = self.wte(ids) + self.wpe(position_ids)
        for q_proj, kv_proj, proj in zip(self.q, self.kv, self.proj):
            q = q_proj(x).view(B, T, self.heads, self.head_dim)  # (B, T, nh, hs)
            k, v = kv_proj(x).view(B, T, 2, self.kv_heads, self.head_dim).unbind(2)  # (B, T, nkv, hs)
            if self.varlen:
                # One row (B == 1) of T tokens; every document is at most T long. Dynamo traces an
                # autograd.Function only if no tensor is passed twice: distinct cu_seqlens for q and k.
                y = flash_attn_varlen_func(
                    q[0], k[0], v[0], cu_seqlens, cu_seqlens.clone(), T, T, causal=True
                )
                y = y[None]
            else:
                y = flash_attn_func(q, k, v, causal=True, window_size=(self.window, 0), softcap=self.softcap)
            x = x + proj(y.reshape(B, T, -1))
        return self.head(x)


class FlashGPTModule(L.LightningModule):
    def __init__(self, **model_kwargs) -> None:
        super().__init__()
        self.model = FlashGPT(**model_kwargs)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        positions = batch.get("position_ids", torch.arange(ids.shape[1], device=ids.device).expand_as(ids))
        cu_seqlens = batch["cu_seqlens"][0] if self.model.varlen else None
        logits = self.model(ids, positions, cu_seqlens)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def cross_document_rel_diff(
    module: L.LightningModule, samples: list[dict], reference_loss: float
) -> float | None:
    """How far the loss moves when attention crosses documents (negative control; one dp group)."""
    if not hasattr(module, "cross_document_loss"):
        return None
    batch = {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}
    return abs(module.cross_document_loss(batch) - reference_loss) / abs(reference_loss)
