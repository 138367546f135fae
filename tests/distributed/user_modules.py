"""Training steps written as users write them for one device, with the idioms the SP pass must prove
exact or refuse: position tables sliced by the length, positions from a cumsum of the mask, a sliding
window equal to the shard length, hand-written losses, labels made inside the step.

Each module is small and seeded by the caller; ``VOCAB`` matches ``tests/distributed/modules.py``.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.associative_scan import associative_scan

from tests.distributed.modules import VOCAB, TinyGPT

# The sizes every tiny HF model here changes of its family's default config.
TINY_HF = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


class _SGD(L.LightningModule):
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Block(nn.Module):
    """Pre-norm attention + MLP block; ``rope`` is applied to q and k when given."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm_1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm_2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.norm_1(x)).split(C, dim=2)
        q, k, v = (
            t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v)
        )  # (B, nh, T, hs)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm_2(x))


def rope_cache(length: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(length).float(), inv_freq).repeat(1, 2)  # (T_max, hs)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.size(-1) // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class SlicedTableGPT(_SGD):
    """Position tables sliced by the length: a learned ``pos_emb[:, :t]`` (minGPT) or a rope cache
    ``cos[:T]`` (litgpt, ``freqs_cis[:seqlen]``)."""

    def __init__(self, positions: str = "learned", dim: int = 32, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.positions = positions
        self.wte = nn.Embedding(VOCAB, dim)
        if positions == "learned":  # no unused parameter: DDP would leave its bucket unreduced
            self.pos_emb = nn.Parameter(0.02 * torch.randn(1, 128, dim))
        cos, sin = rope_cache(128, dim // heads)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, VOCAB)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        t = ids.size(1)
        x = self.wte(ids)
        rope = None
        if self.positions == "learned":
            x = x + self.pos_emb[:, :t]
        else:
            rope = (self.cos[:t], self.sin[:t])
        for block in self.blocks:
            x = block(x, rope)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class LossGPT(_SGD):
    """The tests' GPT with the loss written another way: ``nll`` (log_softmax + nll_loss), ``sum_over_count``
    (HF's num_items_in_batch style), ``roll`` (labels rolled inside the step), ``mean_none`` (per-token
    losses averaged by hand)."""

    def __init__(self, loss: str, **model_kwargs) -> None:
        super().__init__()
        self.loss = loss
        self.model = TinyGPT(**model_kwargs)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        labels = batch.get("labels", ids)
        logits = self.model(ids)
        if self.loss == "nll":
            return F.nll_loss(F.log_softmax(logits[:, :-1], dim=-1).transpose(1, 2), labels[:, 1:])
        if self.loss == "sum_over_count":
            shifted = labels[:, 1:]
            total = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), shifted.reshape(-1), reduction="sum")
            return total / (shifted != -100).sum()
        if self.loss == "roll":
            targets = torch.roll(labels, -1, 1)
            return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets[:, :-1].reshape(-1))
        if self.loss == "mean_none":
            per_token = F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], reduction="none")
            valid = (labels[:, 1:] != -100).float()
            return (per_token * valid).sum() / valid.sum()
        raise ValueError(self.loss)


class HFModule(_SGD):
    """An HF causal LM built from its family's default config with only sizes changed (random init), with
    the attention transformers picks for it; HF shifts the labels inside its loss.
    ``gradient_checkpointing=True`` turns on HF's own checkpointing, as long-context fine-tuning does."""

    def __init__(self, family: str, gradient_checkpointing: bool = False, **config) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForCausalLM

        sizes = {**TINY_HF, "max_position_embeddings": 256, **config}
        self.model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **sizes))
        if gradient_checkpointing:
            self.model.gradient_checkpointing_enable()

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
        return self.model(**inputs, labels=batch.get("labels", batch["input_ids"])).loss


class HFClassifierModule(_SGD):
    """An HF sequence classifier (``num_labels=1``: a reward model) from a default config with only sizes
    changed: it pools the last non-padding token (padding id 0) and takes its loss against
    ``batch["label"]``; ``config`` overrides sizes."""

    def __init__(self, family: str = "llama", num_labels: int = 3, **config) -> None:
        super().__init__()
        from transformers import AutoConfig, AutoModelForSequenceClassification

        sizes = {**TINY_HF, **config}
        hf_config = AutoConfig.for_model(family, num_labels=num_labels, pad_token_id=0, **sizes)
        self.model = AutoModelForSequenceClassification.from_config(hf_config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], labels=batch["label"]).loss


class ReadmeLlama(_SGD):
    """README's usage example, unchanged but for sizes: ``LlamaConfig`` at its defaults (``use_cache=True``:
    every layer appends its keys and values to an empty ``DynamicCache`` in training too)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM

        self.model = LlamaForCausalLM(LlamaConfig(**TINY_HF))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss


class MetricLlama(ReadmeLlama):
    """README's Llama with a torchmetrics accuracy updated and logged in ``training_step`` (issue 48): the
    metric's labels ``ids[:, 1:]`` and HF's padded, shifted labels are two windows of the ids, which the
    partitioner once merged on the rank that sends nothing (Note [Collectives kept apart] in steps.py)."""

    def __init__(self) -> None:
        super().__init__()
        from torchmetrics.classification import MulticlassAccuracy

        self.acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")

    def training_step(self, batch, batch_idx):
        out = self.model(input_ids=batch["input_ids"], labels=batch["input_ids"])
        self.acc(out.logits[:, :-1].argmax(-1).reshape(-1), batch["input_ids"][:, 1:].reshape(-1))
        self.log("train_acc", self.acc, on_step=True)
        return out.loss


class MultimodalQwen(_SGD):
    """Qwen2-VL given multimodal rotary positions by the collator: ``position_ids`` [B, 3, S] (temporal,
    height and width per token), the sequence on dim 2, not on the batch's seq_dim. Text only: the vision
    tower gets no gradient (DDP needs ``find_unused_parameters=True``)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        text = {**TINY_HF, "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]}}
        vision = {"depth": 1, "embed_dim": 16, "hidden_size": 32, "num_heads": 2}
        self.model = Qwen2VLForConditionalGeneration(Qwen2VLConfig(text_config=text, vision_config=vision))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        positions = batch["position_ids"].transpose(0, 1)  # HF takes [3, B, S]
        ids = batch["input_ids"]
        return self.model(input_ids=ids, position_ids=positions, labels=ids).loss


# A tiny LLaVA's image: 28 x 28 pixels in 14 x 14 patches, 4 features, each at a placeholder token.
IMAGE_SIZE, IMAGE_TOKENS, IMAGE_TOKEN_ID = 28, 4, VOCAB - 1


class LlavaModule(_SGD):
    """LLaVA (CLIP vision tower, projector, Llama) from its default config with only sizes changed (and the
    image token id inside the tiny vocabulary). HF puts the image features into the token embeddings at
    the placeholder tokens with ``masked_scatter``; the batch carries ``pixel_values`` (one image per
    sample) and ``input_ids`` with ``IMAGE_TOKENS`` placeholders each."""

    def __init__(self, vision_layers: int = 2) -> None:
        super().__init__()
        from transformers import LlavaConfig, LlavaForConditionalGeneration

        text = {**TINY_HF, "model_type": "llama", "num_hidden_layers": 1, "max_position_embeddings": 256}
        vision = dict(
            model_type="clip_vision_model",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=vision_layers,  # features from the last but one layer (the default)
            num_attention_heads=2,
            image_size=IMAGE_SIZE,
            patch_size=14,
        )
        config = LlavaConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID)
        self.model = LlavaForConditionalGeneration(config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids, pixels = batch["input_ids"], batch["pixel_values"]
        return self.model(input_ids=ids, pixel_values=pixels, labels=batch["labels"]).loss


def with_images(batch: dict, starts: list[int], generator: torch.Generator) -> dict:
    """``batch`` with one image per sample: ``IMAGE_TOKENS`` placeholders from ``starts[i]`` in sample i
    (labels ignored there, as HF's processors do) and its pixels."""
    ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    ids[ids == IMAGE_TOKEN_ID] = 0  # no stray placeholder
    for row, start in enumerate(starts):
        ids[row, start : start + IMAGE_TOKENS] = IMAGE_TOKEN_ID
        labels[row, start : start + IMAGE_TOKENS] = -100
    pixels = torch.randn(ids.shape[0], 3, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    return {**batch, "input_ids": ids, "labels": labels, "pixel_values": pixels}


def multimodal_positions(length: int) -> torch.Tensor:
    """[3, S] rotary positions, one row per section; the rows differ, so a position read from another
    token or section changes the loss."""
    tokens = torch.arange(length)
    return torch.stack([tokens, tokens // 2, tokens % 5])


class LitGPTModule(_SGD):
    """litgpt's ``GPT`` (rope cache sliced ``cos[:T]``), built from a config."""

    def __init__(self, **config) -> None:
        super().__init__()
        from litgpt.config import Config
        from litgpt.model import GPT

        defaults = dict(
            block_size=128,
            vocab_size=VOCAB,
            padded_vocab_size=VOCAB,
            n_layer=2,
            n_head=4,
            n_query_groups=2,
            n_embd=32,
            intermediate_size=64,
            bias=False,
            norm_class_name="RMSNorm",
            mlp_class_name="LLaMAMLP",
            rotary_percentage=1.0,
        )
        self.model = GPT(Config(**{**defaults, **config}))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self.model(ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


@torch.compiler.disable
def eager_token_mean(x: torch.Tensor) -> torch.Tensor:
    """A helper left out of the compiled graph: run eagerly, it sees this rank's tokens only."""
    return x.mean(dim=1, keepdim=True)


def chunked_running_sum(x: torch.Tensor, chunk: int = 4) -> torch.Tensor:
    """A running sum over the sequence, computed chunk by chunk in a Python loop over the chunk count of the
    sequence padded to whole chunks: how the torch paths of hybrids' scans (Qwen3-Next's gated delta rule)
    compute, with their Python reading the length."""
    batch, length, dim = x.shape
    x = F.pad(x, (0, 0, 0, (chunk - length % chunk) % chunk))
    chunks = x.view(batch, -1, chunk, dim)
    state, outputs = x.new_zeros(batch, dim), []
    for i in range(chunks.size(1)):
        running = chunks[:, i].cumsum(1) + state[:, None]
        outputs.append(running)
        state = running[:, -1]
    return torch.stack(outputs, 1).view(batch, -1, dim)[:, :length]


class SequenceIdiomGPT(_SGD):
    """The tests' GPT with one idiom that mixes tokens outside attention.

    Exact by redistribution: ``hand_written_attention`` softmax(QK^T)V; ``sort_over_sequence`` sorts
    activations along the sequence; ``cumsum_of_activations`` a running sum of activations;
    ``pool_last_token`` a loss on the last position (which lives on one rank); ``conv_over_sequence`` a full
    (not grouped) causal convolution over the sequence (a window with the previous rank's last positions);
    ``insert_token`` a learned token inserted into the sequence (it grows by one, every shard shifts).
    Refused when traced at the shard's length, naming this file's line, and exact at the whole sequence's
    (``trace_length="whole"``): ``branch_on_length`` a Python branch on the length that the shard and the
    whole sequence take differently; ``chunked_scan`` a running sum chunk by chunk in a Python loop;
    ``associative_scan`` a gated running sum by torch's ``associative_scan``, which recurses on halves of the
    sequence and combines them under ``torch.vmap`` (Jamba's Mamba scan).
    ``every_other_token``: aten's ``slice`` with step 2 along the sequence, on the whole sequence for a block
    of channels. ``gated_norm_over_heads``: every head's row normed, the tokens flattened between the
    batch and the heads, then viewed back (exact); ``heads_before_tokens`` views those rows back in another
    dim order and ``rows_flattened_two_ways`` adds rows flattened in two orders (both refused: Note [Views
    of flattened tokens]). ``truncate_to_fixed_length``: ``if T > 16: ids = ids[:, -16:]``, a branch on the
    length and a sequence of a fixed number of tokens after it, mixed by a running sum.
    ``eager_token_mean``: a mean over the tokens in a function under ``torch.compiler.disable``, which runs
    eagerly on this rank's tokens (refused: Note [Eager code between graphs]).
    """

    def __init__(self, idiom: str, dim: int = 32) -> None:
        super().__init__()
        self.idiom = idiom
        # Only parameters the step uses: DDP leaves a bucket with an unused one unreduced.
        self.wte = nn.Embedding(VOCAB, dim)
        self.head = nn.Linear(dim, VOCAB)
        if idiom == "conv_over_sequence":
            self.conv = nn.Conv1d(dim, dim, kernel_size=3, padding=2)
        if idiom == "insert_token":
            self.start = nn.Parameter(torch.zeros(1, 1, dim))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        if self.idiom == "truncate_to_fixed_length" and ids.size(1) > 16:
            ids = ids[:, -16:]  # the last 16 tokens, as one device keeps them
        x = self.wte(ids)  # (B, T, C)
        if self.idiom == "hand_written_attention":
            scores = (x @ x.transpose(1, 2)).softmax(dim=-1)  # (B, T, T)
            x = scores @ x
        elif self.idiom == "sort_over_sequence":
            x = x.sort(dim=1).values
        elif self.idiom == "branch_on_length" and ids.size(1) > 16:
            x = x.cumsum(dim=1)
        elif self.idiom == "conv_over_sequence":
            x = self.conv(x.transpose(1, 2))[..., : ids.size(1)].transpose(1, 2)
        elif self.idiom in ("cumsum_of_activations", "truncate_to_fixed_length"):
            x = x.cumsum(dim=1)
        elif self.idiom == "chunked_scan":
            x = chunked_running_sum(x)
        elif self.idiom == "associative_scan":  # Jamba's: h_t = a_t * h_(t-1) + b_t by halves, through vmap
            _, x = associative_scan(
                lambda left, right: (left[0] * right[0], right[0] * left[1] + right[1]),
                (torch.sigmoid(x), x),
                dim=1,
                combine_mode="generic",
            )
        elif self.idiom == "eager_token_mean":  # refused: eager code between graphs on sequence data
            x = x + eager_token_mean(x)
        elif self.idiom == "every_other_token":  # aten's slice with a step, as torch's own scans write it
            x = x + torch.ops.aten.slice.Tensor(x, 1, 0, None, 2).mean(dim=1, keepdim=True)
        elif self.idiom == "insert_token":
            x = torch.cat([self.start.expand(x.size(0), 1, -1), x], dim=1)[:, 1:]
        elif self.idiom == "gated_norm_over_heads":  # Qwen3.5's gated norm: every head's row, then back
            rows = x.view(*ids.shape, 4, -1).reshape(-1, x.size(-1) // 4)  # (B * T * 4, C / 4)
            rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * F.silu(rows)
            x = rows.reshape(*ids.shape, -1).cumsum(dim=1)
        elif self.idiom == "heads_before_tokens":  # the rows of tokens-then-heads read as heads-then-tokens
            rows = x.view(*ids.shape, 4, -1).reshape(-1, x.size(-1) // 4)
            x = (
                rows.reshape(4, ids.size(1), -1)
                .transpose(0, 1)
                .reshape(ids.size(1), ids.size(0), -1)
                .transpose(0, 1)
            )
        elif self.idiom == "rows_flattened_two_ways":  # (B, T, H) rows plus (B, H, T) rows, index by index
            heads = x.view(*ids.shape, 4, -1)
            rows = heads.reshape(-1, x.size(-1) // 4) + heads.transpose(1, 2).reshape(-1, x.size(-1) // 4)
            x = rows.reshape(*ids.shape, -1)
        logits = self.head(x)
        if self.idiom == "pool_last_token":
            return F.cross_entropy(logits[:, -1], ids[:, 0])
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
