"""The benchmarked models, and the hand edits the hand-written baselines need.

Two models, both causal language models trained on next-token loss:

* ``gpt``: ``examples.models.TinyGPT``, a hand-written GPT (learned positions from ``arange``, SDPA).
* ``llama``: Hugging Face ``LlamaForCausalLM`` from a config (RoPE, GQA), ``attn_implementation="sdpa"``.

``ModelSpec`` presets give tiny shapes for CPU runs and the shapes of Llama-3.2-1B and Llama-3.1-8B for GPU
runs (``layers`` can be cut to fit a time budget). Every method builds its own instance from the same
state dict, so the weights are identical everywhere.

The single-device training step (``full_sequence_loss``) is what this project and DeepSpeed's AutoSP
compile unchanged. The hand-written baselines need the edits a user would make by hand, kept here:

* ``sharded_loss``: a loss over this rank's slice of the sequence with explicit global positions and
  targets shifted before sharding, summed and divided by the global number of targets (so summing the
  ranks' gradients gives the single-device gradient);
* ``attention="ulysses"``: DeepSpeed's ``DistributedAttention`` (all-to-all around a local causal SDPA)
  in every attention layer; K/V heads fewer than the ranks are repeated to one per rank first, as
  DeepSpeed's HF Ulysses (ALST's ``UlyssesSPAttentionHF``) does;
* ``attention="ring"``: a plain causal SDPA without mask, K/V repeated to every head (what
  ``context_parallel`` intercepts);
* ``attention="causal"``: a causal SDPA without mask for the full-sequence baseline. Under
  ``torch.compile`` HF's own SDPA path materializes its causal mask as an [S, S] tensor (which the CPU
  kernel turns into fp32: 64 MiB at 4096 tokens); this keeps the baseline free of that.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

Attention = Literal["sdpa", "causal", "ulysses", "ring"]
IGNORE_INDEX = -100


@dataclass(frozen=True)
class ModelSpec:
    family: Literal["gpt", "llama"]
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int = 0  # llama's MLP width (gpt uses 4 * hidden)
    max_len: int = 8192  # gpt's learned position table
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rms_norm_eps: float = 1e-6

    def describe(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v not in (None, 0)}

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

PRESETS: dict[str, ModelSpec] = {
    "gpt-tiny": ModelSpec("gpt", vocab_size=256, hidden=128, layers=2, heads=8, kv_heads=8, max_len=8192),
    "llama-tiny": ModelSpec(
        "llama", vocab_size=256, hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256
    ),
    # Llama-3-8B's proportions at llama-tiny's width: MLP 3.5x hidden, 4 query heads per KV head
    "llama3-proportions": ModelSpec(
        "llama", vocab_size=256, hidden=128, layers=2, heads=8, kv_heads=2, intermediate=448
    ),
    "gpt-smoke": ModelSpec("gpt", vocab_size=64, hidden=64, layers=2, heads=4, kv_heads=4, max_len=256),
    "llama-smoke": ModelSpec(
        "llama", vocab_size=64, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=128
    ),
    # Llama-3.2-1B and Llama-3.1-8B shapes (random init)
    "llama-1b": ModelSpec(
        "llama",
        vocab_size=128256,
        hidden=2048,
        layers=16,
        heads=32,
        kv_heads=8,
        intermediate=8192,
        tie_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5,
    ),
    "llama-8b": ModelSpec(
        "llama",
        vocab_size=128256,
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=8,
        intermediate=14336,
        rope_theta=500000.0,
        rope_scaling=_LLAMA3_ROPE,
        rms_norm_eps=1e-5,
    ),
}


def preset(name: str, layers: int | None = None) -> ModelSpec:
    if name not in PRESETS:
        raise ValueError(f"Unknown model {name!r}; use one of {', '.join(PRESETS)}.")
    spec = PRESETS[name]
    return replace(spec, layers=layers) if layers else spec


# --------------------------------------------------------------------------------------------------
# attention for the hand-written baselines


def causal_sdpa_bshd(query: Tensor, key: Tensor, value: Tensor) -> Tensor:
    """Causal SDPA on [B, S, H, D] (DistributedAttention's layout); K/V may have fewer heads."""
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, H, S, D)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)  # (B, S, H, D)


class UlyssesSelfAttention(nn.Module):
    """``examples.models.CausalSelfAttention`` with DeepSpeed's ``DistributedAttention`` around SDPA.

    Shares the projections of the attention it replaces (same parameter names, same weights).
    """

    def __init__(self, attention: nn.Module, group: Any) -> None:
        super().__init__()
        from deepspeed.sequence.layer import DistributedAttention

        self.n_head = attention.n_head
        self.qkv, self.proj = attention.qkv, attention.proj
        # [B, S/P, H, D] -> all-to-all -> [B, S, H/P, D] -> SDPA -> all-to-all -> [B, S/P, H, D]
        self.attention = DistributedAttention(causal_sdpa_bshd, group, scatter_idx=2, gather_idx=1)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape  # T: this rank's tokens
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head) for t in self.qkv(x).split(C, dim=2))
        y = self.attention(q, k, v, 0)  # batch_dim_idx=0; (B, T, nh, hs)
        return self.proj(y.reshape(B, T, C))


def _hf_ulysses_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args, **kwargs):
    """HF attention interface: [B, H, S/P, D] in, [B, S/P, H, D] out, via ``module.distributed_attention``.

    With fewer K/V heads than ranks, each is repeated ``module.kv_replication`` times first (one per rank
    of its query heads), as DeepSpeed's own HF Ulysses (``UlyssesSPAttentionHF``) does; the repeat's
    backward sums the copies' gradients.
    """
    if module.kv_replication > 1:
        key, value = (t.repeat_interleave(module.kv_replication, dim=1) for t in (key, value))
    out = module.distributed_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), 0)
    return out, None


def _hf_causal_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args, **kwargs):
    """HF attention interface: causal SDPA without a mask, GQA left to SDPA: [B, H, S, D] -> [B, S, H, D]."""
    enable_gqa = key.shape[1] != query.shape[1]
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=enable_gqa)
    return out.transpose(1, 2), None


def _hf_ring_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, *args, **kwargs):
    """HF attention interface: causal SDPA without a mask, K/V repeated to every query head.

    ``context_parallel``'s ring kernels see plain [B, H, S, D] tensors with the same head count.
    """
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True)
    return out.transpose(1, 2), None


_HF_ATTENTION = {
    "ulysses": "benchmarks_ulysses",
    "ring": "benchmarks_ring_sdpa",
    "causal": "benchmarks_causal_sdpa",
}
_HF_FUNCTIONS = {"ulysses": _hf_ulysses_attention, "ring": _hf_ring_attention, "causal": _hf_causal_attention}


def _register_hf_attention() -> None:
    """Name our attention functions in transformers' attention and mask registries (idempotent).

    The mask function returns None: these attentions are causal by construction, and HF would otherwise
    build a mask at this rank's local length.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for kind, function in _HF_FUNCTIONS.items():
        AttentionInterface.register(_HF_ATTENTION[kind], function)
        AttentionMaskInterface.register(_HF_ATTENTION[kind], lambda *args, **kwargs: None)


# --------------------------------------------------------------------------------------------------
# building


def build(spec: ModelSpec, attention: Attention = "sdpa", group: Any = None) -> nn.Module:
    """A fresh model with seed-0 weights (the same for every call with the same spec)."""
    torch.manual_seed(0)
    if spec.family == "gpt":
        from examples.models import TinyGPT

        model = TinyGPT(spec.vocab_size, spec.max_len, spec.layers, spec.heads, spec.hidden)
        if attention == "ulysses":
            for block in model.blocks:
                block.attn = UlyssesSelfAttention(block.attn, group)
        return model

    from transformers import LlamaConfig, LlamaForCausalLM

    if attention != "sdpa":
        _register_hf_attention()
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=max(spec.max_len, 131072),
        rope_theta=spec.rope_theta,
        rope_scaling=spec.rope_scaling,
        rms_norm_eps=spec.rms_norm_eps,
        tie_word_embeddings=spec.tie_embeddings,
        attn_implementation=_HF_ATTENTION.get(attention, "sdpa"),
    )
    model = LlamaForCausalLM(config)
    if attention == "ulysses":
        from deepspeed.sequence.layer import DistributedAttention

        world = torch.distributed.get_world_size(group)
        if spec.kv_heads % world and world % spec.kv_heads:
            raise ValueError(f"Ulysses: {spec.kv_heads} K/V heads, {world} ranks: neither divides the other")
        for layer in model.model.layers:
            layer.self_attn.distributed_attention = DistributedAttention(
                causal_sdpa_bshd, group, scatter_idx=2, gather_idx=1
            )
            layer.self_attn.kv_replication = max(1, world // spec.kv_heads)
    return model


def full_sequence_loss(spec: ModelSpec, model: nn.Module) -> Callable[[dict], Tensor]:
    """The single-device training step: batch ``{"input_ids": [B, S]}`` -> mean next-token loss."""
    if spec.family == "gpt":

        def gpt_step(batch: dict) -> Tensor:
            ids = batch["input_ids"]
            logits = model(ids)
            return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1))

        return gpt_step

    def llama_step(batch: dict) -> Tensor:
        return model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    return llama_step


def shifted_targets(ids: Tensor) -> Tensor:
    """Next-token targets aligned with every position, ``IGNORE_INDEX`` at the last: [B, S] -> [B, S]."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], IGNORE_INDEX)], dim=1)


def gpt_logits(model: nn.Module, ids: Tensor, positions: Tensor) -> Tensor:
    """``TinyGPT.forward`` with explicit positions (its own uses ``arange`` of the local length)."""
    x = model.wte(ids) + model.wpe(positions)
    for block in model.blocks:
        x = block(x)
    return model.lm_head(model.ln_f(x))


def sharded_loss(spec: ModelSpec, model: nn.Module) -> Callable[[Tensor, Tensor, Tensor, int], Tensor]:
    """Hand-written sequence-parallel step: this rank's share of the loss over all ranks' targets.

    ``(ids, positions, targets, n_targets)`` are this rank's [B, S_r] slices and the global number of
    valid targets; the sum over ranks of the returned values is the single-device mean loss.
    """

    def step(ids: Tensor, positions: Tensor, targets: Tensor, n_targets: int) -> Tensor:
        if spec.family == "gpt":
            logits = gpt_logits(model, ids, positions)
        else:  # HF's own loss upcasts the logits too
            logits = model(input_ids=ids, position_ids=positions).logits.float()
        total = F.cross_entropy(
            logits.reshape(-1, logits.size(-1)),
            targets.reshape(-1),
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        return total / n_targets

    return step


class GPTWithLoss(nn.Module):
    """TinyGPT and its training loss as one module, for engines that call ``module(input_ids, labels)``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, labels: Tensor) -> Tensor:
        logits = self.model(input_ids)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1))
