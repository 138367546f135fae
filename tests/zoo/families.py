"""The model zoo: causal-LM families people fine-tune for long context, each built tiny from a config.

Every family is run by ``tests/zoo/worker.py`` through ``lightning_autosp.verify`` at an even and an odd
length with sp=2 (aot_eager), a few also under Inductor + SAC, and must meet its expectation here: exact
(loss <= 1e-5, gradients <= 1e-4 on every rank) or refused with an error containing ``refusal``, the
same on every rank. ``python -m benchmarks.zoo`` runs them all and writes the README's table.

Tiny: hidden 32, 2 layers, 4 heads and 2 KV heads where the family has them (head dim 8), vocabulary
48, every dropout 0. Shard lengths (13 and 14 tokens) differ from every model dimension, so no size is
ambiguous between the sequence and the model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L

from tests.distributed.modules import VOCAB

EVEN_LENGTH, ODD_LENGTH = 26, 27
BATCH_SIZE = 2


@dataclass(frozen=True)
class Family:
    """One row of the zoo: how to build it, what it exercises, and what the SP pass must make of it."""

    build: Callable[[], L.LightningModule]
    exercises: str
    refusal: str | None = None  # None: exact; else a fragment of the refusal every rank must raise
    inductor: bool = False  # also run at the odd length under Inductor + SAC
    vocab: int = VOCAB
    config: dict[str, Any] = field(default_factory=dict)


NO_GPT2_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def hf(family: str, **config: Any) -> Callable[[], L.LightningModule]:
    from tests.distributed.user_modules import HFModule

    return lambda: HFModule(family, **config)


def litgpt(**config: Any) -> Callable[[], L.LightningModule]:
    from tests.distributed.user_modules import LitGPTModule

    return lambda: LitGPTModule(**config)


def nanogpt() -> L.LightningModule:
    from examples.models import GPTModule

    return GPTModule(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=32)


def mingpt() -> L.LightningModule:
    from tests.distributed.user_modules import SlicedTableGPT

    return SlicedTableGPT(positions="learned")


MOE_SORT = "orders values (sort) along the sequence"

FAMILIES: dict[str, Family] = {
    "llama": Family(hf("llama"), "GQA (4 q / 2 KV heads), rotary", inductor=True),
    "mistral": Family(hf("mistral", head_dim=8, sliding_window=8), "sliding window (8) shorter than a shard"),
    "qwen2": Family(hf("qwen2"), "q/k/v biases"),
    "qwen3": Family(hf("qwen3", head_dim=8), "q/k RMSNorm per head"),
    "gemma3_text": Family(
        hf(
            "gemma3_text",
            head_dim=8,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention"],
            query_pre_attn_scalar=8,
        ),
        "sliding and global layers, q/k norm, scaled embeddings",
    ),
    "phi3": Family(hf("phi3", pad_token_id=0), "fused qkv and gate/up projections"),
    "gpt2": Family(
        hf("gpt2", n_inner=64, **NO_GPT2_DROPOUT),
        "learned positions, Conv1D (addmm) projections",
    ),
    "gpt_neox": Family(hf("gpt_neox"), "partial rotary (25%), parallel residual, fused qkv"),
    "opt": Family(
        hf("opt", ffn_dim=64, word_embed_proj_dim=32, dropout=0.0),
        "learned positions from a cumsum of the mask",
    ),
    "falcon": Family(hf("falcon", num_kv_heads=1), "multi-query (1 KV head), parallel attention, rotary"),
    "falcon-alibi": Family(hf("falcon", num_kv_heads=1, alibi=True), "ALiBi position bias"),
    "starcoder2": Family(hf("starcoder2", sliding_window=8), "sliding window, biases, LayerNorm"),
    "olmo2": Family(hf("olmo2"), "q/k RMSNorm over all heads, post-norm blocks"),
    "phi": Family(hf("phi", **NO_GPT2_DROPOUT), "partial rotary (50%), parallel attention and MLP"),
    "cohere": Family(hf("cohere"), "interleaved rotary, parallel block, logit scale"),
    "gptj": Family(hf("gptj", rotary_dim=4, n_inner=64), "interleaved partial rotary (rotary_dim)"),
    "gpt_bigcode": Family(
        hf("gpt_bigcode", n_inner=64, **NO_GPT2_DROPOUT), "multi-query (1 KV head), learned positions"
    ),
    "mixtral": Family(
        hf("mixtral", num_local_experts=4, num_experts_per_tok=2),
        "mixture of experts (top-2 of 4)",
        refusal=MOE_SORT,
    ),
    "qwen2_moe": Family(
        hf(
            "qwen2_moe",
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=64,
        ),
        "mixture of experts with a shared expert",
        refusal=MOE_SORT,
    ),
    "gemma2-eager": Family(
        hf("gemma2", head_dim=8, attn_implementation="eager"),
        "attention written out (transformers builds gemma2 without SDPA)",
        refusal="attention written by hand",
    ),
    "litgpt": Family(litgpt(), "litgpt GPT, Llama-style: rope cache sliced cos[:T]", inductor=True),
    "litgpt-neox": Family(
        litgpt(
            rotary_percentage=0.25,
            parallel_residual=True,
            norm_class_name="LayerNorm",
            mlp_class_name="GptNeoxMLP",
            bias=True,
            n_query_groups=4,
        ),
        "litgpt GPT, Pythia-style: partial rotary, parallel residual",
    ),
    "nanogpt": Family(nanogpt, "nanoGPT-style: learned positions from arange, fused qkv"),
    "mingpt": Family(mingpt, "minGPT-style: learned position table sliced pos_emb[:, :T]"),
}
