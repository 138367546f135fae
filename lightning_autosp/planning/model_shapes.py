"""What the planner needs to know about a model: its shapes (``ModelShape``), read from an ``nn.Module``,
a Hugging Face config, TinyGPT's config dict, or given directly (``LLAMA_3_1_8B``, ``LLAMA_3_1_70B``).

Shape letters as in ``planner.py``.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["LLAMA_3_1_70B", "LLAMA_3_1_8B", "ModelShape", "hf_builds_mask_under_compile", "model_shape"]


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs to know about a decoder-only transformer.

    ``params`` is the exact count when a module was given; otherwise it is computed from the shapes.
    ``attention_mask``: the model builds an explicit [S, S] causal mask for attention (HF transformers
    does under ``torch.compile`` with torch < 2.14); with sp_size > 1 the SP pass replaces it by
    ``is_causal=True``, so it costs memory at sp_size=1 only. ``repeats_kv``: the model repeats K/V to
    all heads before attention (HF does when it builds a mask).
    ``loss_in_fp32``: logits are cast to fp32 before the loss (HF).
    """

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    gated_mlp: bool = True
    norm: Literal["rms", "layer"] = "rms"
    bias: bool = False
    rotary: bool = True
    learned_positions: int = 0
    tied_embeddings: bool = False
    attention_mask: bool = False
    repeats_kv: bool = False
    loss_in_fp32: bool = False
    params: int | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads}.")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(f"hidden={self.hidden} is not divisible by heads={self.heads}; give head_dim.")

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def attention_width(self) -> int:
        """H * D: the width of q and of the attention output (may differ from ``hidden``)."""
        return self.heads * self.d

    @property
    def layer_params(self) -> int:
        h, q, kv, inner = self.hidden, self.attention_width, self.kv_heads * self.d, self.intermediate
        attention = h * (q + 2 * kv) + q * h + (q + 2 * kv + h if self.bias else 0)
        matrices = 3 if self.gated_mlp else 2
        mlp = matrices * h * inner + (inner + h if self.bias and not self.gated_mlp else 0)
        norms = 2 * h * (2 if self.norm == "layer" else 1)
        return attention + mlp + norms

    @property
    def layer_matrix_params(self) -> int:
        """The largest weight matrix of a layer (q/k/v fused or not, it is at most this)."""
        h, q, kv = self.hidden, self.attention_width, self.kv_heads * self.d
        return max(h * (q + 2 * kv), h * self.intermediate)

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.learned_positions * self.hidden

    @property
    def matmul_weight_params(self) -> int:
        """Weights that feed matmuls (cast to bf16 under autocast): all layers' and the LM head."""
        h, q, kv = self.hidden, self.attention_width, self.kv_heads * self.d
        per_layer = h * (q + 2 * kv) + q * h + (3 if self.gated_mlp else 2) * h * self.intermediate
        return self.layers * per_layer + self.vocab * h

    @property
    def param_count(self) -> int:
        if self.params is not None:
            return self.params
        final_norm = self.hidden * (2 if self.norm == "layer" else 1)
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return self.embedding_params + self.layers * self.layer_params + final_norm + head

    def kv_heads_at_attention(self, sp_size: int) -> int:
        """K/V heads that reach attention (and its all-to-all) on ``sp_size`` ranks.

        HF repeats K/V to all heads when it passes a mask; the SP pass (sp_size > 1) undoes that repeat
        and repeats them only to a multiple of ``sp_size`` when they cannot be split
        (``compiler/sp_pass.py``).
        """
        if self.repeats_kv and sp_size == 1:
            return self.heads
        if self.kv_heads % sp_size:
            return self.kv_heads * (sp_size // math.gcd(self.kv_heads, sp_size))
        return self.kv_heads


# Shapes of meta-llama/Llama-3.1-8B and -70B (their config.json). Attention as torch >= 2.14 runs HF
# models under compile: no mask, K/V heads not repeated (``model_shape(LlamaConfig(...))`` on older
# torch sets ``repeats_kv``, as measured).
LLAMA_3_1_8B = ModelShape(
    hidden=4096,
    layers=32,
    heads=32,
    kv_heads=8,
    intermediate=14336,
    vocab=128256,
    loss_in_fp32=True,
    name="Llama-3.1-8B",
)
LLAMA_3_1_70B = ModelShape(
    hidden=8192,
    layers=80,
    heads=64,
    kv_heads=8,
    intermediate=28672,
    vocab=128256,
    loss_in_fp32=True,
    name="Llama-3.1-70B",
)


def hf_builds_mask_under_compile() -> bool:
    """Whether HF transformers materializes the causal mask when the model runs under torch.compile.

    transformers (``masking_utils._ignore_causal_mask_sdpa``) skips the mask and passes
    ``is_causal=True`` unless Dynamo reports exporting, which it does for every compile before torch
    2.14 (pytorch#176499). Measured with torch 2.13 and transformers 5.24: a [1, 1, S, S] mask.
    """
    return torch.torch_version.TorchVersion(torch.__version__) < (2, 14)


_GATED_MODEL_TYPES = {"llama", "mistral", "mixtral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "olmo2"}


def _from_hf_config(config: Any, params: int | None = None, name: str = "") -> ModelShape:
    get = lambda key, default=None: getattr(config, key, None) or default
    hidden, heads = get("hidden_size"), get("num_attention_heads")
    layers, vocab = get("num_hidden_layers"), get("vocab_size")
    if None in (hidden, heads, layers, vocab):
        raise TypeError(
            f"{type(config).__name__} lacks hidden_size, num_attention_heads, num_hidden_layers or "
            "vocab_size; pass a ModelShape instead."
        )
    model_type = get("model_type", "")
    gated = model_type in _GATED_MODEL_TYPES or get("hidden_act", "") in ("silu", "swish")
    intermediate = get("intermediate_size") or get("n_inner") or 4 * hidden
    mask = hf_builds_mask_under_compile()
    learned = 0 if get("rope_theta") or get("rope_parameters") or gated else get("max_position_embeddings", 0)
    return ModelShape(
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=get("num_key_value_heads", heads),
        intermediate=intermediate,
        vocab=vocab,
        head_dim=get("head_dim"),
        gated_mlp=gated,
        norm="rms" if get("rms_norm_eps") else "layer",
        bias=bool(get("attention_bias") or get("mlp_bias") or not gated),
        rotary=learned == 0,
        learned_positions=learned,
        tied_embeddings=bool(get("tie_word_embeddings", False)),
        attention_mask=mask,
        repeats_kv=mask,
        loss_in_fp32=True,
        params=params,
        name=name or model_type,
    )


def _from_gpt_config(config: Mapping[str, Any], params: int | None = None, name: str = "") -> ModelShape:
    """``examples.models.TinyGPT``'s constructor arguments (also GPTModule's hparams)."""
    hidden = config["n_embd"]
    return ModelShape(
        hidden=hidden,
        layers=config["n_layer"],
        heads=config["n_head"],
        kv_heads=config["n_head"],
        intermediate=4 * hidden,
        vocab=config["vocab_size"],
        gated_mlp=False,
        norm="layer",
        bias=True,
        rotary=False,
        learned_positions=config.get("block_size", 1024),
        params=params,
        name=name or "TinyGPT",
    )


def _is_gpt_config(config: Mapping[str, Any]) -> bool:
    return all(key in config for key in ("n_embd", "n_layer", "n_head", "vocab_size"))


def _distinct_param_count(module: nn.Module) -> int:
    seen: dict[Any, int] = {}
    for p in module.parameters():
        # Tied parameters are one object on meta and as DTensors (already sharded in configure_model)
        plain = p.device.type != "meta" and not isinstance(p, DTensor)
        key = (p.device, p.untyped_storage().data_ptr()) if plain else id(p)
        seen.setdefault(key, p.numel())
    return sum(seen.values())


def model_shape(model_or_config: Any) -> ModelShape:
    """A :class:`ModelShape` from a ModelShape, an HF config (LlamaConfig, ...), TinyGPT's config dict,
    or an ``nn.Module`` (its parameters counted; shapes from a ``config`` attribute on it or a
    submodule, or from a LightningModule's ``hparams``)."""
    if isinstance(model_or_config, ModelShape):
        return model_or_config
    if isinstance(model_or_config, nn.Module):
        params = _distinct_param_count(model_or_config)
        name = type(model_or_config).__name__
        for module in model_or_config.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "num_hidden_layers"):
                return _from_hf_config(config, params, name)
        hparams = getattr(model_or_config, "hparams", None)
        if isinstance(hparams, Mapping) and hparams:
            shape = model_shape(dict(hparams))
            return replace(shape, params=params, name=name)
        raise TypeError(
            f"Cannot read the shapes of {name}: it has no HF `config` attribute (on it or a submodule) and "
            "no hparams with TinyGPT's (n_embd, n_layer, n_head, vocab_size) or HF names (hidden_size, ...). "
            "Pass a ModelShape(hidden=..., layers=..., heads=..., kv_heads=..., intermediate=..., vocab=...)."
        )
    if isinstance(model_or_config, Mapping):
        if _is_gpt_config(model_or_config):
            return _from_gpt_config(model_or_config)
        if "hidden_size" in model_or_config:
            return _from_hf_config(argparse.Namespace(**model_or_config))
        raise TypeError(
            f"A config dict needs TinyGPT's keys (n_embd, n_layer, n_head, vocab_size) or HF's (hidden_size, "
            f"num_hidden_layers, num_attention_heads, vocab_size); got {sorted(model_or_config)}."
        )
    if hasattr(model_or_config, "num_hidden_layers"):
        return _from_hf_config(model_or_config, name=type(model_or_config).__name__.removesuffix("Config"))
    raise TypeError(
        f"Cannot plan for a {type(model_or_config).__name__}; pass an nn.Module, an HF config, TinyGPT's "
        "config dict or a ModelShape."
    )
