"""The grammar of the differential fuzzer (``benchmarks/fuzz.py``): what a random case is made of.

A case is a ``Spec``: one choice per grammar element (``ELEMENTS``, each element's choices listed most
common first, the first its simplest), the sequence parallel degree, the batch and the length.
``benchmarks/fuzz_source.py`` turns a spec into the source of a module, so the module that runs is the
module a defect report prints.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from dataclasses import dataclass, replace

# Each element's choices, most common first; the first is the simplest (what shrinking tries).
ELEMENTS: dict[str, tuple[str, ...]] = {
    "positions": (
        "none",
        "embedding_arange",
        "table_slice",
        "table_index",
        "position_ids",
        "rotary",
        "rotary_cache",
        "alibi",
    ),
    "mixer": (
        "sdpa",
        "manual_attention",
        "multihead_attention",
        "cumsum",
        "causal_conv",
        "suffix_sum",
        "flip",
        "associative_scan",
    ),
    "mask": ("causal", "bidirectional", "window"),
    "mask_spelling": ("is_causal", "bool", "float"),
    "kv_heads": ("same", "gqa_enable", "gqa_repeat"),
    "mha_layout": ("batch_first", "seq_first"),
    "mha_weights": ("need_weights_false", "default"),
    "norm": ("layernorm", "rmsnorm", "none"),
    "mlp": ("gelu", "swiglu", "none"),
    "residual": ("yes", "no"),
    "final_norm": ("yes", "no"),
    "head": (
        "lm",
        "pool_mean",
        "token_classifier",
        "pool_last",
        "pool_first",
        "pool_max",
        "pool_sum",
        "pool_masked_mean",
    ),
    "pool_spelling": (
        "plain",
        "negative_dim",
        "functional",
        "keepdim",
        "adaptive_pool",
        "other",
        "after_head",
    ),
    "head_bias": ("no", "yes"),
    "label_shift": ("none", "in_step"),
    "loss": (
        "ce_mean",
        "ce_sum",
        "ce_smooth",
        "z_loss",
        "mse",
        "ce_transpose",
        "nll_log_softmax",
        "weighted",
        "masked_mean",
        "per_sequence",
        "pairwise_logsigmoid",
        "pairwise_softplus",
        "bce",
    ),
    "ignore_index": ("none", "scattered", "tail"),
    "aux_loss": ("none", "hidden_mean_square", "logits_mean_square", "hidden_abs_sum"),
    "layers": ("1", "2"),
    "heads": ("sp", "2sp"),
    # last, so that a seed draws the elements above as it did before these were added
    "features": ("none", "placeholders", "placeholders_expanded", "per_element"),
    "assign": ("none", "sections"),
    # the first norm over rows of a flattened view, viewed back: every head's row (Qwen3.5's gated norm,
    # [B * T * H, DH]) or every token's ([B * T, D])
    "rows": ("tokens", "head_rows", "flat_tokens"),
}
TOKEN_LOSSES = (
    "ce_mean",
    "ce_sum",
    "ce_smooth",
    "z_loss",
    "mse",
    "ce_transpose",
    "nll_log_softmax",
    "weighted",
    "masked_mean",
    "per_sequence",
)
POOLED_LOSSES = (
    "ce_mean",
    "ce_sum",
    "ce_smooth",
    "z_loss",
    "mse",
    "pairwise_logsigmoid",
    "pairwise_softplus",
    "bce",
)
CROSS_ENTROPY_LOSSES = (
    "ce_mean",
    "ce_sum",
    "ce_smooth",
    "z_loss",
    "ce_transpose",
    "nll_log_softmax",
    "weighted",
    "masked_mean",
    "per_sequence",
)
ATTENTION_MIXERS = ("sdpa", "manual_attention", "multihead_attention")
# Weights of the choices where "most common first" is not enough: the context's report (a pooled head
# over a causal GPT) and per-sequence losses get extra weight.
WEIGHTS: dict[str, tuple[float, ...]] = {
    "positions": (1, 3, 2, 1, 1, 1, 1, 1),
    "mixer": (6, 2, 2, 1, 1, 1, 1, 1),
    "head": (3, 3, 2, 2, 2, 2, 2, 2),
    "ignore_index": (3, 1, 1),
    "aux_loss": (4, 1, 1, 1),
    "features": (4, 1, 1, 1),
    "assign": (3, 1),
    "rows": (4, 1, 1),
}
# Each element's choice that leaves it out of the module (shrinking tries these first).
DROPPED = {
    "aux_loss": "none",
    "layers": "1",
    "final_norm": "no",
    "mlp": "none",
    "norm": "none",
    "positions": "none",
    "ignore_index": "none",
    "label_shift": "none",
    "head_bias": "no",
    "kv_heads": "same",
    "pool_spelling": "plain",
    "features": "none",
    "assign": "none",
    "rows": "tokens",
}
MAX_LEN = 40  # lengths stay below it; position tables hold it
SP_SIZES = (2, 3, 4)
PRIMES = frozenset({5, 7, 11, 13, 17, 19, 23, 29, 31, 37})


@dataclass(frozen=True)
class Spec:
    """One case: a choice per element, the sp degree, the batch size and the sequence length."""

    choices: tuple[tuple[str, str], ...] = ()  # (element, choice), in ``ELEMENTS``' order
    sp: int = 2
    batch: int = 2
    length: int = 8

    def __getitem__(self, element: str) -> str:
        return dict(self.choices)[element]

    def with_choice(self, element: str, choice: str) -> Spec:
        return normalized(replace(self, choices=tuple({**dict(self.choices), element: choice}.items())))

    @property
    def length_class(self) -> str:
        if self.length in PRIMES:
            return "prime"
        return "even" if self.length % 2 == 0 else "odd"

    def used(self) -> dict[str, str]:
        """The elements that shape the module (the others were normalized away), for coverage."""
        attention = self["mixer"] in ATTENTION_MIXERS
        unused = set()
        if not attention:
            unused |= {"mask", "mask_spelling", "kv_heads", "mha_layout", "mha_weights", "heads"}
        elif self["mixer"] == "multihead_attention":
            unused |= {"kv_heads"}
        else:
            unused |= {"mha_layout", "mha_weights"}
        if self["mixer"] == "manual_attention":
            unused.add("mask_spelling")
        if self["head"].startswith("pool"):
            unused |= {"label_shift", "ignore_index"}
        else:
            unused.add("pool_spelling")
        return {element: choice for element, choice in self.choices if element not in unused}

    def describe(self) -> str:
        used = ", ".join(f"{element}={choice}" for element, choice in self.used().items())
        return f"sp={self.sp} batch={self.batch} length={self.length}: {used}"


def normalized(spec: Spec) -> Spec:
    """Make dependent choices agree (a loss the head can take, a mask its spelling can say)."""
    choices = dict(spec.choices)
    if choices["mixer"] not in ("sdpa", "manual_attention"):
        choices["positions"] = {"rotary": "none", "alibi": "none"}.get(
            choices["positions"], choices["positions"]
        )
    pooled = choices["head"].startswith("pool")
    if choices["loss"] not in (POOLED_LOSSES if pooled else TOKEN_LOSSES):
        choices["loss"] = "ce_mean"
    if pooled or choices["loss"] not in CROSS_ENTROPY_LOSSES:
        choices["ignore_index"] = "none"
    if pooled:
        choices["label_shift"] = "none"
    if choices["head"] == "pool_masked_mean" and choices["pool_spelling"] not in ("plain", "after_head"):
        choices["pool_spelling"] = "plain"
    # written out (or nn.MultiheadAttention's) masks have no is_causal flag
    if (
        choices["mixer"] in ("manual_attention", "multihead_attention")
        and choices["mask_spelling"] == "is_causal"
    ):
        choices["mask_spelling"] = "bool"
    if choices["mixer"] == "multihead_attention":
        choices["kv_heads"] = "same"
    if choices["mixer"] == "manual_attention" and choices["kv_heads"] == "gqa_enable":
        choices["kv_heads"] = "gqa_repeat"
    if choices["mask"] != "causal" and choices["mask_spelling"] == "is_causal":
        choices["mask_spelling"] = "bool"
    if choices["positions"] == "alibi" and choices["mask_spelling"] == "is_causal":
        choices["mask_spelling"] = "float"  # the bias rides in a float mask
    length = max(spec.length, 2 * spec.sp)
    return replace(spec, choices=tuple(choices.items()), length=length)


def sample(rng: random.Random) -> Spec:
    choices = {
        element: rng.choices(options, weights=WEIGHTS.get(element))[0]
        for element, options in ELEMENTS.items()
    }
    sp = rng.choice(SP_SIZES)
    length_class = rng.choice(("odd", "even", "prime"))
    lengths = [n for n in range(2 * sp, MAX_LEN) if _length_class(n) == length_class]
    return normalized(
        Spec(tuple(choices.items()), sp=sp, batch=rng.choice((1, 2, 3)), length=rng.choice(lengths))
    )


def simplest(sp: int = 2) -> Spec:
    return normalized(Spec(tuple((element, options[0]) for element, options in ELEMENTS.items()), sp=sp))


def _length_class(length: int) -> str:
    if length in PRIMES:
        return "prime"
    return "even" if length % 2 == 0 else "odd"


def shrink_moves() -> list[Callable[[Spec], Spec]]:
    """Each way to make a spec one step simpler: a batch of 1, sp 2, the shortest length (first: they make
    every later try cheaper), one element at its simplest choice or left out (each result normalized)."""
    moves: list[Callable[[Spec], Spec]] = [
        lambda spec: replace(spec, batch=1),
        lambda spec: normalized(replace(spec, sp=2)),
        lambda spec: replace(spec, length=2 * spec.sp),
        lambda spec: replace(spec, length=2 * spec.sp + 1),
    ]
    moves += [  # where an element can be left out, that is simpler than its simplest choice
        functools.partial(Spec.with_choice, element=element, choice=options[0])
        for element, options in ELEMENTS.items()
        if element not in DROPPED
    ]
    moves += [
        functools.partial(Spec.with_choice, element=element, choice=choice)
        for element, choice in DROPPED.items()
    ]
    return moves
