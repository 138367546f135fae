"""Small causal language models for the examples.

``TinyGPT`` is a hand-written GPT in plain PyTorch: the shape of model the AutoSP compiler passes must
handle without help. ``LlamaModule`` uses Hugging Face's ``LlamaForCausalLM`` (random init, no
download) to show the same strategy on an off-the-shelf model.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torchmetrics import MeanMetric  # a dependency of lightning; listed in the examples extra too
from torchmetrics.classification import MulticlassAccuracy

from lightning_autosp.extras import require

__all__ = ["GPTModule", "LlamaModule", "TinyGPT"]

IGNORE_INDEX = -100


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.n_embd = n_embd
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()  # batch size, sequence length, embedding dimensionality (n_embd)
        hs = C // self.n_head

        q, k, v = self.qkv(x).split(self.n_embd, dim=2)  # (B, T, C) each
        q = q.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, hs).transpose(1, 2)  # (B, nh, T, hs)

        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(nn.Module):
    """A minimal GPT-2 style decoder: learned positions, pre-LayerNorm blocks, SDPA attention."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 1024,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList(Block(n_embd, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # GPT-2 initialisation; PyTorch's defaults train noticeably slower at this size.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Map token ids ``(B, T)`` to next-token logits ``(B, T, vocab_size)``."""
        B, T = idx.size()
        if T > self.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.block_size}")
        pos = torch.arange(T, device=idx.device)  # (T,)
        x = self.wte(idx) + self.wpe(pos)  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))  # (B, T, V)


def _shifted_targets(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Next-token targets, aligned with ``logits[:, :-1]``; explicit labels win over the inputs."""
    return batch.get("labels", batch["input_ids"])[:, 1:]


class GPTModule(L.LightningModule):
    """Next-token training of :class:`TinyGPT`, logging ``train_loss``, ``val_loss``, ``val_acc`` (next-token
    accuracy, a torchmetrics metric updated in the step) and ``val_ppl``.

    ``val_ppl`` is ``exp`` of the mean ``val_loss`` over the validation batches: the perplexity when every
    batch has the same number of supervised tokens (fixed-length batches, as in the examples' data).
    """

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 1024,
        n_layer: int = 2,
        n_head: int = 4,
        n_embd: int = 128,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = TinyGPT(vocab_size, block_size, n_layer, n_head, n_embd)
        self.val_loss_mean = MeanMetric()
        self.val_accuracy = MulticlassAccuracy(vocab_size, average="micro", ignore_index=IGNORE_INDEX)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        V = logits.size(-1)
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), targets.reshape(-1), ignore_index=IGNORE_INDEX)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits = self.model(batch["input_ids"])
        loss = self._loss(logits, _shifted_targets(batch))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits, targets = self.model(batch["input_ids"]), _shifted_targets(batch)
        loss = self._loss(logits, targets)
        self.log("val_loss", loss, prog_bar=True, sync_dist=True)
        self.val_loss_mean.update(loss)
        # per-token metrics as on one device: AutoSPStrategy hands them the whole sequence
        self.val_accuracy(logits[:, :-1].reshape(-1, logits.size(-1)), targets.reshape(-1))
        self.log("val_acc", self.val_accuracy, on_epoch=True)
        return loss

    def on_validation_epoch_end(self) -> None:
        self.log("val_ppl", torch.exp(self.val_loss_mean.compute()))
        self.val_loss_mean.reset()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )


class LlamaModule(L.LightningModule):
    """Causal-LM training of a randomly initialised Hugging Face Llama; logs ``train_loss``, ``val_loss``.

    The defaults are a tiny model for CPU runs; ``examples/configs/llama_*.yaml`` set the shapes of
    Llama-3.2-1B and Llama-3.1-8B (``rope_theta``, ``rope_scaling`` and ``rms_norm_eps`` as in their configs;
    ``rope_scaling`` is a Hugging Face ``rope_scaling`` dict such as ``{"rope_type": "llama3", ...}``).
    ``meta_init=True`` builds the model in ``configure_model`` on the meta device: with
    ``AutoSPStrategy(data_parallel="fsdp")`` each rank then allocates and initialises only its shard
    (with ``"ddp"``, the whole model), so no process ever holds the whole model on the CPU.
    """

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 128,
        intermediate_size: int = 256,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = 4096,
        rope_theta: float = 10000.0,
        rope_scaling: dict[str, Any] | None = None,
        rms_norm_eps: float = 1e-6,
        tie_word_embeddings: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
        meta_init: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = None if meta_init else self._build()

    def configure_model(self) -> None:
        if self.model is None:
            with torch.device("meta"):
                self.model = self._build()

    def _build(self) -> nn.Module:
        # Imported here so that the rest of this module works without the optional ``hf`` extra.
        require("transformers", extra="hf", needed_by="examples.models.LlamaModule")
        from transformers import LlamaConfig, LlamaForCausalLM

        h = self.hparams
        config = LlamaConfig(
            vocab_size=h.vocab_size,
            hidden_size=h.hidden_size,
            intermediate_size=h.intermediate_size,
            num_hidden_layers=h.num_hidden_layers,
            num_attention_heads=h.num_attention_heads,
            num_key_value_heads=h.num_key_value_heads,
            max_position_embeddings=h.max_position_embeddings,
            rope_theta=h.rope_theta,
            rope_scaling=h.rope_scaling,
            rms_norm_eps=h.rms_norm_eps,
            tie_word_embeddings=h.tie_word_embeddings,
        )
        return LlamaForCausalLM(config)

    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        return self.model(input_ids=input_ids, **kwargs)

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch.get("labels", batch["input_ids"])).loss

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(
            self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay
        )
