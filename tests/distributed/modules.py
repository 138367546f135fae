"""Tiny LightningModules written as a user would write them for one device, for parity tests."""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 48
WINDOW = 6


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, mask: str) -> None:
        super().__init__()
        self.heads, self.mask = heads, mask
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, shared_mask: torch.Tensor | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        if shared_mask is not None:  # one causal mask the model builds for every layer
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=shared_mask)
        elif self.mask == "triu":
            future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=x.device), diagonal=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=~future)
        elif self.mask == "window":  # causal, and only the last WINDOW tokens: not plain causal
            ones = torch.ones(T, T, dtype=torch.bool, device=x.device)
            hidden = torch.triu(ones, diagonal=1) | torch.tril(ones, diagonal=-WINDOW)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=~hidden)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class TinyGPT(nn.Module):
    def __init__(
        self,
        dim: int = 32,
        heads: int = 4,
        layers: int = 2,
        mask: str = "causal",
        graph_break: str | None = None,
    ):
        super().__init__()
        self.graph_break = graph_break
        self.wte = nn.Embedding(VOCAB, dim)
        self.wpe = nn.Embedding(256, dim)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(layers))
        self.attns = nn.ModuleList(Attention(dim, heads, mask) for _ in range(layers))
        self.mlps = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim)) for _ in range(layers)
        )
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.size(1), device=ids.device))
        T = ids.size(1)
        mask = None
        if self.attns[0].mask == "shared":
            mask = torch.ones(T, T, dtype=torch.bool, device=ids.device).tril()
        if self.graph_break == "between_layers":  # unrolled: Dynamo resumes after each break
            x = self.layer(0, x)
            torch._dynamo.graph_break()
            x = self.layer(1, x)
            return self.head(x)
        for index in range(len(self.attns)):
            x = self.layer(index, x, mask)
            if self.graph_break == "in_loop":  # Dynamo gives up on the whole frame
                torch._dynamo.graph_break()
        return self.head(x)

    def layer(self, index: int, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attns[index](self.norms[index](x), mask)
        return x + self.mlps[index](x)


class GPTModule(L.LightningModule):
    """The loss, with its causal shift, is written in training_step."""

    def __init__(self, **model_kwargs) -> None:
        super().__init__()
        self.model = TinyGPT(**model_kwargs)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        labels = batch.get("labels", ids)
        logits = self.model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.training_step(batch, batch_idx)
        self.log("val_loss", loss)
        return loss

    def test_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.training_step(batch, batch_idx)
        self.log("test_loss", loss)
        return loss

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(batch["input_ids"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class LlamaModule(L.LightningModule):
    """HF Llama from a config; HF shifts the labels inside its loss."""

    def __init__(self, heads: int = 4, kv_heads: int = 2, layers: int = 2, hidden: int = 32) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            max_position_embeddings=256,
        )
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch.get("labels", batch["input_ids"])).loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class TokenizedLlamaModule(LlamaModule):
    """HF Llama called with a tokenizer's ``attention_mask`` (all ones: no padding): HF then builds a
    mask and repeats the K/V heads for SDPA itself (``repeat_kv``) instead of passing ``enable_gqa``."""

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss


class UserShardedGPTModule(GPTModule):
    """Shards itself in configure_model, as with Lightning's ModelParallelStrategy (FSDP2, all ranks).

    ``units="model"``: the whole model, called from the compiled step.
    ``units="head_then_model"``: the LM head too, which then runs eagerly (FSDP2 calls it through its
    hooks, and Dynamo does not compile torch's own ``nn.Linear.forward`` as a frame of its own).
    ``units="blocks"``: every attention and MLP block, which the model calls inside its loop over layers.
    """

    def __init__(self, units: str = "model", **model_kwargs) -> None:
        super().__init__(**model_kwargs)
        self.units = units

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.units == "blocks":
            for block in [*self.model.attns, *self.model.mlps]:
                fully_shard(block)
        elif self.units == "head_then_model":
            fully_shard(self.model.head)
        fully_shard(self.model)
