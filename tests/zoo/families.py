"""The model zoo: the families people fine-tune for long context, each built tiny from its default config.

Every family is run by ``tests/zoo/worker.py`` through ``lightning_autosp.tools.verify`` at an even and an odd
length with sp=2 (aot_eager), a few also under Inductor + SAC, and must meet its expectation here: exact
(loss <= 1e-5, gradients <= 1e-4 on every rank) or refused with an error containing ``refusal``, the
same on every rank. ``python -m benchmarks.zoo`` runs them all and writes the README's table.

Each family is built as its users build it: the default config with only sizes changed (and dropout set
to 0, for parity), the attention transformers picks, ``use_cache`` as the config sets it. Tiny: hidden 32,
4 heads and 2 KV heads where the family has them (head dim 8), vocabulary 48; one layer where every layer
is alike (a second repeats the same ops on the same layouts: compile time, not coverage), two for Llama
(the model users start from) and where layers differ (sliding and global attention, dense and MoE
blocks, convolution or scan and attention, one checkpointed region per layer). Shard lengths (13 and 14
tokens) differ from every model dimension, so no size is ambiguous between the sequence and the
model. HF causal LMs, litgpt and hand-written GPTs, torch's own attention modules, hybrids of linear
attention, convolutions and state-space scans (2026's gated delta nets and Mamba-2 hybrids among them),
mixtures of experts, a vision-language model, classifiers and reward models.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import lightning as L

from tests.distributed.modules import VOCAB

EVEN_LENGTH, ODD_LENGTH = 26, 27
BATCH_SIZE = 2
# The depth of a family whose layers are all alike (module docstring); the others name theirs.
ALIKE_LAYERS = 1


@dataclass(frozen=True)
class Family:
    """One row of the zoo: how to build it, what it exercises, and what the SP pass must make of it."""

    build: Callable[[], L.LightningModule]
    exercises: str
    refusal: str | None = None  # None: exact; else a fragment of the refusal every rank must raise
    inductor: bool = False  # also run at the odd length under Inductor + SAC
    vocab: int = VOCAB
    classes: int = 0  # > 0: a classifier, its batch carries one label per sample
    images: bool = False  # its batch carries an image per sample and placeholders across the shard cut
    config: dict[str, Any] = field(default_factory=dict)
    # its (even, odd) lengths where the zoo's are too short for what it does (whole chunks of a scan)
    lengths: tuple[int, int] | None = None

    def length(self, zoo_length: int) -> int:
        """The length this family runs at in place of one of the zoo's (EVEN_LENGTH or ODD_LENGTH)."""
        if self.lengths is None or zoo_length not in (EVEN_LENGTH, ODD_LENGTH):
            return zoo_length
        return self.lengths[zoo_length == ODD_LENGTH]


NO_GPT2_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
DEEPSEEK = dict(
    kv_lora_rank=16,
    q_lora_rank=16,
    qk_rope_head_dim=4,
    qk_nope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
)
# The Mamba-2 mixers of Bamba, Granite 4 and Falcon-H1: 4 heads of 8, chunks of 8 tokens
MAMBA2 = dict(
    mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=8, mamba_expand=1
)
# Qwen3-Next and Qwen3.5: a gated delta net layer, then an attention layer
GATED_DELTA = dict(
    layers=2,
    layer_types=["linear_attention", "full_attention"],
    head_dim=8,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def hf(family: str, layers: int | None = ALIKE_LAYERS, **config: Any) -> Callable[[], L.LightningModule]:
    """``layers=None``: the config sets its depth another way (a list of block types)."""
    from tests.distributed.user_modules import HFModule

    depth = {} if layers is None else {"num_hidden_layers": layers}
    return lambda: HFModule(family, **depth, **config)


def hf_classifier(num_labels: int) -> Callable[[], L.LightningModule]:
    from tests.distributed.user_modules import HFClassifierModule

    return lambda: HFClassifierModule("llama", num_labels=num_labels, num_hidden_layers=ALIKE_LAYERS)


def litgpt(**config: Any) -> Callable[[], L.LightningModule]:
    from tests.distributed.user_modules import LitGPTModule

    return lambda: LitGPTModule(n_layer=ALIKE_LAYERS, **config)


def mixer(name: str, **kwargs: Any) -> Callable[[], L.LightningModule]:
    from tests.distributed import mixer_modules

    return lambda: getattr(mixer_modules, name)(**kwargs)


def llava() -> L.LightningModule:
    from tests.distributed.user_modules import LlavaModule

    return LlavaModule()


def nanogpt() -> L.LightningModule:
    from examples.models import GPTModule

    return GPTModule(vocab_size=VOCAB, block_size=64, n_layer=ALIKE_LAYERS, n_head=4, n_embd=32)


def mingpt() -> L.LightningModule:
    from tests.distributed.user_modules import SlicedTableGPT

    return SlicedTableGPT(positions="learned", layers=ALIKE_LAYERS)


FAMILIES: dict[str, Family] = {
    # HF causal LMs: SDPA
    "llama": Family(hf("llama", layers=2), "GQA (4 q / 2 KV heads), rotary, KV cache on", inductor=True),
    "mistral": Family(hf("mistral", head_dim=8, sliding_window=8), "sliding window (8) shorter than a shard"),
    "qwen2": Family(hf("qwen2"), "q/k/v biases"),
    "qwen3": Family(hf("qwen3", head_dim=8), "q/k RMSNorm per head"),
    "gemma3_text": Family(
        hf(
            "gemma3_text",
            layers=2,
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
    "granite": Family(hf("granite"), "scaled residuals, embeddings and logits"),
    "stablelm": Family(hf("stablelm"), "partial rotary, LayerNorm"),
    "llama-gradient-checkpointing": Family(
        hf("llama", layers=2, gradient_checkpointing=True),
        "HF gradient_checkpointing_enable(): the regions inlined, SAC decides",
    ),
    "llama_dynamic_rope": Family(
        hf(
            "llama",
            max_position_embeddings=16,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        ),
        "dynamic-NTK rope past max_position_embeddings: inv_freq recomputed in Python from the largest "
        "position, a branch on a tensor's value: several graphs, frames Dynamo gives up on run eagerly",
        inductor=True,
    ),
    # HF causal LMs whose attention transformers writes out (eager by default)
    "gemma2": Family(
        hf("gemma2", layers=2, head_dim=8), "attention written out, soft-capping: split over heads"
    ),
    "bloom": Family(
        hf("bloom", hidden_dropout=0.0, attention_dropout=0.0),
        "ALiBi in baddbmm, written-out attention, a custom autograd GeLU",
    ),
    # mixtures of experts (transformers' grouped_mm dispatch) and multi-head latent attention
    "mixtral": Family(
        hf("mixtral", num_local_experts=4, num_experts_per_tok=2),
        "mixture of experts (top-2 of 4): this rank's tokens sorted by expert and back",
        inductor=True,
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
    ),
    "qwen3_moe": Family(
        hf("qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=8),
        "mixture of experts, q/k norm",
    ),
    "deepseek_v3": Family(
        hf("deepseek_v3", layers=2, **DEEPSEEK), "multi-head latent attention, grouped routing"
    ),
    "deepseek_v2": Family(
        hf("deepseek_v2", layers=2, **DEEPSEEK), "latent attention, complex rotary (polar)"
    ),
    # hybrids: short convolutions, state-space scans
    "lfm2": Family(
        hf(
            "lfm2",
            layers=2,
            layer_types=["conv", "full_attention"],
            block_ff_dim=64,
            conv_L_cache=3,
            block_auto_adjust_ff_dim=False,
        ),
        "hybrid: gated short causal convolutions (depthwise) and attention",
    ),
    "bamba": Family(
        hf(
            "bamba",
            layers=2,
            attn_layer_indices=[1],
            **MAMBA2,
        ),
        "hybrid: Mamba-2 chunked scan (torch path) and attention",
    ),
    # 2026's hybrids: gated delta nets, Mamba and Mamba-2 scans with attention and experts (issue 49)
    "qwen3_next": Family(
        hf(
            "qwen3_next",
            **GATED_DELTA,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        ),
        "hybrid: gated delta rule over chunks of 64 (torch path), gated attention, experts; traced again at "
        "the whole length (130 / 131 tokens)",
        # its Python loops over the chunks of the whole sequence (issue 49), of which 3 at these lengths
        lengths=(130, 131),
    ),
    "qwen3_5_text": Family(
        hf("qwen3_5_text", **GATED_DELTA),
        "hybrid: Qwen3.5's text model, gated delta rule and gated attention, its gated norm over every "
        "head's row; traced again at the whole length (130 / 131 tokens)",
        # its gated norm's [B * S * H, D] rows are viewed back to [B, S, H * D] (Note [Views of flattened
        # tokens] in compiler/prove/rules/shapes.py)
        lengths=(130, 131),
    ),
    "jamba": Family(
        hf(
            "jamba",
            layers=2,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=8,
            mamba_expand=1,
            mamba_dt_rank=4,
        ),
        "hybrid: Mamba selective scan (torch's associative_scan: a recursion over halves through vmap, "
        "traced at the whole length), attention, experts",
        inductor=True,
    ),
    "granitemoehybrid": Family(
        hf(
            "granitemoehybrid",
            layers=2,
            layer_types=["mamba", "attention"],
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=32,
            **MAMBA2,
        ),
        "hybrid: Granite 4, Mamba-2 chunked scan padded to whole chunks, attention, experts",
        inductor=True,
    ),
    "nemotron_h": Family(
        hf(
            "nemotron_h",
            layers=None,
            layers_block_type=["mamba", "moe", "attention", "mlp"],
            head_dim=8,
            ssm_state_size=8,
            mamba_num_heads=4,
            mamba_head_dim=8,
            n_groups=1,
            chunk_size=8,
            expand=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            moe_shared_expert_intermediate_size=16,
        ),
        "hybrid: Mamba-2, experts, attention and MLP blocks",
    ),
    "falcon_h1": Family(
        hf(
            "falcon_h1",
            layers=2,
            head_dim=8,
            mamba_d_ssm=32,
            **MAMBA2,
        ),
        "hybrid: Mamba-2 and attention side by side in each block",
    ),
    "mamba2": Family(
        hf("mamba2", num_heads=4, head_dim=8, state_size=8, n_groups=1, chunk_size=8, expand=1),
        "Mamba-2 alone (no attention): chunked scan, causal convolution",
    ),
    # vision-language
    "llava": Family(
        llava,
        "CLIP tower (replicated) + Llama: image features scattered to placeholders across the cut",
        inductor=True,
        images=True,
    ),
    # classification and reward heads
    "llama-sequence-classification": Family(
        hf_classifier(3),
        "last non-padding token pooled (picked where it lives, all-reduced)",
        classes=3,
        inductor=True,
    ),
    "llama-reward-model": Family(hf_classifier(1), "one score from the last token, MSE", classes=1),
    # litgpt and hand-written models
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
    "written-attention": Family(
        mixer("WrittenAttentionGPT", layers=ALIKE_LAYERS), "softmax(q k^T) v with a tril mask, by hand"
    ),
    "alibi-mask": Family(
        mixer("AlibiGPT", layers=ALIKE_LAYERS), "SDPA with a per-head [H, S, S] ALiBi mask", inductor=True
    ),
    "meta-llama": Family(
        mixer("MetaLlamaBlockLM"), "complex rotary (view_as_complex), keys built in place, custom Function"
    ),
    "linear-attention-hybrid": Family(
        mixer("HybridLM"),
        "causal linear attention (einsum + cumsum), depthwise causal conv, SDPA",
        inductor=True,
    ),
    "mean-pool-classifier": Family(
        mixer("PooledClassifier", pool="mean"), "mean over tokens, MLP head", classes=3
    ),
    # torch's own modules
    "torch-transformer-encoder": Family(
        mixer("TransformerEncoderLM", layers=ALIKE_LAYERS), "nn.TransformerEncoder(..., is_causal=True)"
    ),
    "torch-multihead-attention": Family(
        mixer("MultiheadAttentionLM", layers=ALIKE_LAYERS), "nn.MultiheadAttention, need_weights default"
    ),
}
