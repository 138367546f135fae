"""A fuzz case's module as Python source (``source``), and the module and batch built from it (``build``).

The source holds only the lines a case's choices select (no branches on them), so a defect's report
prints exactly the module that ran, ready to paste into a test.
"""

from __future__ import annotations

import linecache
from typing import Any

import torch

from benchmarks.fuzz_grammar import MAX_LEN, Spec

VOCAB = 50
TOKEN_CLASSES = 5
SEQUENCE_CLASSES = 3
WINDOW = 3
IGNORED_TAIL = 3

_PRELUDE = """import torch
import torch.nn.functional as F
from torch import nn
from torch._higher_order_ops.associative_scan import associative_scan

D, H, KV, DH = {dim}, {heads}, {kv_heads}, {head_dim}
VOCAB, OUT, MAX_LEN, WINDOW, LAYERS = {vocab}, {out}, {max_len}, {window}, {layers}
"""

_RMSNORM = """

class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
"""

_ROTATE = """

def rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
"""


def sizes(spec: Spec) -> dict[str, int]:
    heads = spec.sp * (2 if spec["heads"] == "2sp" else 1)
    head_dim = 8 if heads <= 4 else 4
    kv_heads = heads if spec["kv_heads"] == "same" else max(1, heads // 2)
    pooled = spec["head"].startswith("pool")
    out = SEQUENCE_CLASSES if pooled else VOCAB if spec["head"] == "lm" else TOKEN_CLASSES
    return {"dim": heads * head_dim, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "out": out}


def _norm(spec: Spec) -> str:
    return {"layernorm": "nn.LayerNorm(D)", "rmsnorm": "RMSNorm(D)"}.get(spec["norm"], "nn.LayerNorm(D)")


def _position_args(spec: Spec) -> str:
    return {"rotary": ", cos, sin", "rotary_cache": ", cos, sin", "alibi": ", bias"}.get(
        spec["positions"], ""
    )


def _allowed(spec: Spec) -> list[str]:
    """Lines that set ``allowed`` ([T, T] bool: query i may see key j), or none when every key is."""
    if spec["mask"] == "causal":
        return ["allowed = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()"]
    if spec["mask"] == "window":
        return [
            "i = torch.arange(T, device=x.device)",
            "allowed = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < WINDOW)",
        ]
    return []


def _float_mask(spec: Spec) -> list[str]:
    """Lines that set ``mask``, an additive float mask (with the ALiBi bias), or none when nothing masks."""
    lines = _allowed(spec)
    if lines:
        lines.append('mask = torch.zeros(T, T, device=x.device).masked_fill(~allowed, float("-inf"))')
    if spec["positions"] == "alibi":
        lines.append("mask = bias + mask" if lines else "mask = bias")
    return lines


def _qkv(spec: Spec) -> tuple[list[str], list[str]]:
    init = [
        "self.q = nn.Linear(D, H * DH)",
        "self.k = nn.Linear(D, KV * DH)",
        "self.v = nn.Linear(D, KV * DH)",
        "self.o = nn.Linear(H * DH, D)",
    ]
    forward = [
        "q = self.q(h).view(B, T, H, DH).transpose(1, 2)",
        "k = self.k(h).view(B, T, KV, DH).transpose(1, 2)",
        "v = self.v(h).view(B, T, KV, DH).transpose(1, 2)",
    ]
    if spec["positions"] in ("rotary", "rotary_cache"):
        forward.append("q, k = rotate(q, cos, sin), rotate(k, cos, sin)")
    if spec["kv_heads"] == "gqa_repeat":
        forward.append("k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)")
    return init, forward


def _sdpa(spec: Spec) -> tuple[list[str], list[str]]:
    init, forward = _qkv(spec)
    extra = ", enable_gqa=True" if spec["kv_heads"] == "gqa_enable" else ""
    if spec["mask_spelling"] == "is_causal":
        call = f"y = F.scaled_dot_product_attention(q, k, v, is_causal=True{extra})"
    elif spec["mask_spelling"] == "bool" and spec["positions"] != "alibi":
        forward += _allowed(spec)
        mask = ", attn_mask=allowed" if _allowed(spec) else ""
        call = f"y = F.scaled_dot_product_attention(q, k, v{mask}{extra})"
    else:
        forward += _float_mask(spec)
        mask = ", attn_mask=mask" if _float_mask(spec) else ""
        call = f"y = F.scaled_dot_product_attention(q, k, v{mask}{extra})"
    forward += [call, "h = self.o(y.transpose(1, 2).reshape(B, T, H * DH))"]
    return init, forward


def _manual_attention(spec: Spec) -> tuple[list[str], list[str]]:
    init, forward = _qkv(spec)
    forward.append("scores = q @ k.transpose(-2, -1) * DH**-0.5")
    if spec["mask_spelling"] == "bool" and spec["positions"] != "alibi":
        forward += _allowed(spec)
        if _allowed(spec):
            forward.append('scores = scores.masked_fill(~allowed, float("-inf"))')
    else:
        forward += _float_mask(spec)
        if _float_mask(spec):
            forward.append("scores = scores + mask")
    forward += ["y = scores.softmax(dim=-1) @ v", "h = self.o(y.transpose(1, 2).reshape(B, T, H * DH))"]
    return init, forward


def _multihead_attention(spec: Spec, bias: bool) -> tuple[list[str], list[str]]:
    batch_first = spec["mha_layout"] == "batch_first"
    init = [f"self.attn = nn.MultiheadAttention(D, H, bias={bias}, batch_first={batch_first})"]
    forward: list[str] = []
    if spec["mask_spelling"] == "bool":
        forward += _allowed(spec)
        mask = ", attn_mask=~allowed" if _allowed(spec) else ""  # True: may not attend
    else:
        forward += _float_mask(spec)
        mask = ", attn_mask=mask" if _float_mask(spec) else ""
    weights = ", need_weights=False" if spec["mha_weights"] == "need_weights_false" else ""
    if batch_first:
        forward.append(f"h = self.attn(h, h, h{mask}{weights})[0]")
    else:
        forward += ["h = h.transpose(0, 1)", f"h = self.attn(h, h, h{mask}{weights})[0].transpose(0, 1)"]
    return init, forward


def _mixer(spec: Spec) -> tuple[list[str], list[str]]:
    mixer = spec["mixer"]
    if mixer == "sdpa":
        return _sdpa(spec)
    if mixer == "manual_attention":
        return _manual_attention(spec)
    if mixer == "multihead_attention":
        return _multihead_attention(spec, bias=spec["head_bias"] == "yes")
    if mixer == "causal_conv":
        return (
            ["self.conv = nn.Conv1d(D, D, 3, padding=2, groups=D)"],
            ["h = self.conv(h.transpose(1, 2))[..., :T].transpose(1, 2)"],
        )
    mixes = {
        "cumsum": "h = self.mix(h).cumsum(dim=1) / torch.arange(1, T + 1, device=x.device).unsqueeze(-1)",
        "suffix_sum": "h = self.mix(h).flip(1).cumsum(dim=1).flip(1) / T",
        "flip": "h = self.mix(h).flip(1)",
        # Jamba's scan: h_t = a_t * h_(t-1) + b_t, by torch's recursion over halves combined under vmap
        "associative_scan": (
            "h = associative_scan(lambda l, r: (l[0] * r[0], r[0] * l[1] + r[1]), "
            "(torch.sigmoid(self.mix(h)), h), dim=1, combine_mode='generic')[1]"
        ),
    }
    return ["self.mix = nn.Linear(D, D)"], [mixes[mixer]]


def _rows(rows: str, norm: str | None) -> list[str]:
    """``h``, the first norm's output, over rows of a flattened view of ``x`` (Note [Views of flattened
    tokens] in lightning_autosp/compiler/prove/rules/shapes.py)."""
    if rows == "head_rows":  # every head's row scaled to unit RMS, as Qwen3.5's gated norm does
        return [
            "rows = x.view(B, T, H, DH).reshape(-1, DH)",
            "rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6)",
            f"h = {norm}(rows.reshape(B, T, -1))" if norm else "h = rows.reshape(B, T, -1)",
        ]
    if rows == "flat_tokens":
        return [
            f"h = {norm}(x.reshape(-1, C)).view(B, T, C)"
            if norm
            else "h = x.reshape(-1, C).tanh().view(B, T, C)"
        ]
    return [f"h = {norm}(x)" if norm else "h = x"]


def _block(spec: Spec) -> list[str]:
    init, forward = ["super().__init__()"], ["B, T, C = x.shape"]
    normed = spec["norm"] != "none"
    if normed:
        init.append(f"self.norm_1 = {_norm(spec)}")
    forward += _rows(spec["rows"], "self.norm_1" if normed else None)
    mixer_init, mixer_forward = _mixer(spec)
    init += mixer_init
    forward += mixer_forward
    forward.append("x = x + h" if spec["residual"] == "yes" else "x = h")
    if spec["mlp"] != "none":
        if normed:
            init.append(f"self.norm_2 = {_norm(spec)}")
        if spec["mlp"] == "gelu":
            init.append("self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))")
            forward.append(f"h = self.mlp({'self.norm_2(x)' if normed else 'x'})")
        else:
            init += [
                "self.gate = nn.Linear(D, 2 * D, bias=False)",
                "self.up = nn.Linear(D, 2 * D, bias=False)",
                "self.down = nn.Linear(2 * D, D, bias=False)",
            ]
            forward += [
                f"h = {'self.norm_2(x)' if normed else 'x'}",
                "h = self.down(F.silu(self.gate(h)) * self.up(h))",
            ]
        forward.append("x = x + h" if spec["residual"] == "yes" else "x = h")
    forward.append("return x")
    return [
        "class Block(nn.Module):",
        "    def __init__(self):",
        *_indent(init, 2),
        "",
        f"    def forward(self, x{_position_args(spec)}):",
        *_indent(forward, 2),
    ]


def _positions(spec: Spec) -> tuple[list[str], list[str]]:
    positions = spec["positions"]
    table = "self.pos = nn.Parameter(torch.randn(MAX_LEN, D) * 0.02)"
    return {
        "none": ([], []),
        "embedding_arange": (
            ["self.pos = nn.Embedding(MAX_LEN, D)"],
            ["x = x + self.pos(torch.arange(T, device=ids.device))"],
        ),
        "table_slice": ([table], ["x = x + self.pos[:T]"]),
        "table_index": ([table], ["x = x + self.pos[torch.arange(T, device=ids.device)]"]),
        "position_ids": (
            ["self.pos = nn.Embedding(MAX_LEN, D)"],
            ['x = x + self.pos(batch["position_ids"])'],
        ),
        "rotary": (
            ['self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, DH, 2).float() / DH))'],
            [
                "angles = torch.outer(torch.arange(T, device=ids.device).float(), self.inv_freq)",
                "cos, sin = angles.cos(), angles.sin()",
            ],
        ),
        "rotary_cache": (  # litgpt's and minGPT-style caches: tables for the longest length, sliced
            [
                "inv_freq = 1.0 / 10000 ** (torch.arange(0, DH, 2).float() / DH)",
                "angles = torch.outer(torch.arange(MAX_LEN).float(), inv_freq)",
                'self.register_buffer("cos_cached", angles.cos())',
                'self.register_buffer("sin_cached", angles.sin())',
            ],
            ["cos, sin = self.cos_cached[:T], self.sin_cached[:T]"],
        ),
        "alibi": (
            ['self.register_buffer("slopes", 2.0 ** -torch.arange(1, H + 1).float())'],
            [
                "i = torch.arange(T, device=ids.device)",
                "bias = -self.slopes[:, None, None] * (i[None, :] - i[:, None]).abs().float()",
            ],
        ),
    }[positions]


# How each pooling over the sequence is spelled ("plain" first; a spelling a pooling lacks is its plain one).
POOLINGS: dict[str, dict[str, str]] = {
    "pool_mean": {
        "plain": "x.mean(dim=1)",
        "negative_dim": "x.mean(dim=-2)",
        "functional": "torch.mean(x, dim=1)",
        "keepdim": "x.mean(dim=1, keepdim=True).squeeze(1)",
        "adaptive_pool": "F.adaptive_avg_pool1d(x.transpose(1, 2), 1).squeeze(-1)",
        "other": "x.sum(dim=1) / T",
    },
    "pool_max": {
        "plain": "x.max(dim=1).values",
        "negative_dim": "x.amax(dim=-2)",
        "functional": "torch.max(x, dim=1)[0]",
        "keepdim": "x.amax(dim=1, keepdim=True).squeeze(1)",
        "adaptive_pool": "F.adaptive_max_pool1d(x.transpose(1, 2), 1).squeeze(-1)",
    },
    "pool_sum": {
        "plain": "x.sum(dim=1)",
        "negative_dim": "x.sum(dim=-2)",
        "functional": "torch.sum(x, dim=1)",
        "keepdim": "x.sum(dim=1, keepdim=True).squeeze(1)",
        "other": "x.mean(dim=1) * T",
    },
    "pool_first": {
        "plain": "x[:, 0]",
        "negative_dim": "x[:, -T]",
        "functional": "x.select(1, 0)",
        "keepdim": "x[:, :1].squeeze(1)",
        "other": "x.narrow(1, 0, 1).squeeze(1)",
    },
    "pool_last": {
        "plain": "x[:, -1]",
        "negative_dim": "x[:, T - 1]",
        "functional": "x.select(1, -1)",
        "keepdim": "x[:, -1:].squeeze(1)",
        "other": "x.narrow(1, T - 1, 1).squeeze(1)",
    },
}


def _head(spec: Spec) -> list[str]:
    head, spelling = spec["head"], spec["pool_spelling"]
    if head == "pool_masked_mean":
        keep = 'keep = batch["attention_mask"].unsqueeze(-1).to(x.dtype)'
        if spelling == "after_head":
            return [keep, "logits = (self.head(x) * keep).sum(dim=1) / keep.sum(dim=1)"]
        return [keep, "pooled = (x * keep).sum(dim=1) / keep.sum(dim=1)", "logits = self.head(pooled)"]
    if head in POOLINGS:
        if spelling == "after_head":  # pool the per-token logits instead of the features
            return [f"logits = {POOLINGS[head]['plain'].replace('x', 'self.head(x)', 1)}"]
        return [
            f"pooled = {POOLINGS[head].get(spelling, POOLINGS[head]['plain'])}",
            "logits = self.head(pooled)",
        ]
    return ["logits = self.head(x)"]


def _token_loss(spec: Spec) -> list[str]:
    loss = spec["loss"]
    lines = ['labels = batch["labels"]']
    shifted = spec["label_shift"] == "in_step"
    cut = "[:, 1:]" if shifted else ""
    if shifted:
        lines += ["logits, labels = logits[:, :-1], labels[:, 1:]"]
    flat = "logits.reshape(-1, OUT), labels.reshape(-1)"
    per_token = 'per_token = F.cross_entropy(logits.transpose(1, 2), labels, reduction="none")'
    lines += {
        "ce_mean": [f"loss = F.cross_entropy({flat})"],
        "ce_sum": [f'loss = F.cross_entropy({flat}, reduction="sum")'],
        "ce_smooth": [f"loss = F.cross_entropy({flat}, label_smoothing=0.1)"],
        "z_loss": [f"loss = F.cross_entropy({flat}) + 1e-4 * torch.logsumexp(logits, dim=-1).pow(2).mean()"],
        "mse": [f'loss = F.mse_loss(logits, batch["target"]{cut})'],
        "ce_transpose": ["loss = F.cross_entropy(logits.transpose(1, 2), labels)"],
        "nll_log_softmax": [
            "loss = F.nll_loss(F.log_softmax(logits, dim=-1).reshape(-1, OUT), labels.reshape(-1))"
        ],
        "weighted": [
            per_token,
            f'weights = batch["weights"]{cut}',
            "loss = (per_token * weights).sum() / weights.sum()",
        ],
        "masked_mean": [
            per_token,
            f'keep = batch["loss_mask"]{cut}',
            "loss = (per_token * keep).sum() / keep.sum()",
        ],
        "per_sequence": [per_token, "loss = per_token.mean(dim=1).mean()"],
    }[loss]
    return lines


def _pooled_loss(spec: Spec) -> list[str]:
    return {
        "ce_mean": ['loss = F.cross_entropy(logits, batch["cls"])'],
        "ce_sum": ['loss = F.cross_entropy(logits, batch["cls"], reduction="sum")'],
        "ce_smooth": ['loss = F.cross_entropy(logits, batch["cls"], label_smoothing=0.1)'],
        "z_loss": [
            'loss = F.cross_entropy(logits, batch["cls"])',
            "loss = loss + 1e-4 * torch.logsumexp(logits, dim=-1).pow(2).mean()",
        ],
        "mse": ['loss = F.mse_loss(logits, batch["target"])'],
        "pairwise_logsigmoid": ["loss = -F.logsigmoid(logits[:, 0] - logits[:, 1]).mean()"],
        "pairwise_softplus": ["loss = F.softplus(logits[:, 1] - logits[:, 0]).mean()"],
        "bce": ['loss = F.binary_cross_entropy_with_logits(logits, batch["target"])'],
    }[spec["loss"]]


# Features put at placeholder tokens (VOCAB - 1), as vision-language models insert image features: each
# spelling of the mask (transformers' [B, T, 1], expanded to the embeddings, per element).
FEATURE_MASKS = {
    "placeholders": "(ids == VOCAB - 1).unsqueeze(-1)",
    "placeholders_expanded": "(ids == VOCAB - 1).unsqueeze(-1).expand_as(x)",
    "per_element": "(ids == VOCAB - 1).unsqueeze(-1) & (torch.arange(D, device=ids.device) % 2 == 0)",
}
FEATURE_DIM = 12


def _case(spec: Spec) -> list[str]:
    pos_init, pos_forward = _positions(spec)
    init = ["super().__init__()", "self.embed = nn.Embedding(VOCAB, D)", *pos_init]
    init.append("self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])")
    step = ['ids = batch["input_ids"]', "B, T = ids.shape", "x = self.embed(ids)"]
    if spec["features"] != "none":
        init.append(f"self.features = nn.Linear({FEATURE_DIM}, D)")
        step += [
            'features = torch.tanh(self.features(batch["features"]))',
            f"x = x.masked_scatter({FEATURE_MASKS[spec['features']]}, features)",
        ]
    step += pos_forward
    step += ["for block in self.blocks:", f"    x = block(x{_position_args(spec)})"]
    if spec["assign"] == "sections":  # rotary sections written into a copy (Qwen3.5's)
        step += ["x = x.clone()", "x[..., 1::3] = torch.tanh(x[..., 1::3])"]
    if spec["final_norm"] == "yes":
        init.append(f"self.norm = {_norm(spec)}")
        step.append("x = self.norm(x)")
    init.append(f"self.head = nn.Linear(D, OUT, bias={spec['head_bias'] == 'yes'})")
    step += _head(spec)
    step += _pooled_loss(spec) if spec["head"].startswith("pool") else _token_loss(spec)
    step += {
        "none": [],
        "hidden_mean_square": ["loss = loss + 0.01 * x.pow(2).mean()"],
        "logits_mean_square": ["loss = loss + 1e-3 * logits.pow(2).mean()"],
        "hidden_abs_sum": ["loss = loss + 1e-4 * x.abs().sum()"],
    }[spec["aux_loss"]]
    step.append("return loss")
    return [
        "class Case(nn.Module):",
        "    def __init__(self):",
        *_indent(init, 2),
        "",
        "    def training_step(self, batch, batch_idx):",
        *_indent(step, 2),
    ]


def _indent(lines: list[str], levels: int) -> list[str]:
    return [" " * 4 * levels + line if line else line for line in lines]


def source(spec: Spec) -> str:
    """The case's module as the source of a class ``Case`` (with ``training_step``) and its helpers."""
    parts = [
        _PRELUDE.format(vocab=VOCAB, max_len=MAX_LEN, window=WINDOW, layers=spec["layers"], **sizes(spec))
    ]
    if spec["norm"] == "rmsnorm":
        parts.append(_RMSNORM)
    if spec["positions"] in ("rotary", "rotary_cache"):
        parts.append(_ROTATE)
    parts += ["\n\n" + "\n".join(_block(spec)) + "\n", "\n\n" + "\n".join(_case(spec)) + "\n"]
    return "".join(parts)


def batch(spec: Spec, seed: int) -> dict[str, torch.Tensor]:
    """The tensors the case's step reads, seeded by ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    shape, out = (spec.batch, spec.length), sizes(spec)["out"]
    made = {"input_ids": torch.randint(0, VOCAB, shape, generator=generator)}
    if spec["features"] != "none":  # a run of 1-4 placeholders in every sample, anywhere
        for row in range(spec.batch):
            run = int(torch.randint(1, 5, (), generator=generator))
            start = int(torch.randint(0, spec.length - run + 1, (), generator=generator))
            made["input_ids"][row, start : start + run] = VOCAB - 1
        placeholders = int((made["input_ids"] == VOCAB - 1).sum())
        made["features"] = torch.randn(placeholders, FEATURE_DIM, generator=generator)
    if spec["positions"] == "position_ids":
        made["position_ids"] = torch.arange(spec.length).expand(shape).clone()
    pooled = spec["head"].startswith("pool")
    loss = spec["loss"]
    if pooled:
        made["cls"] = torch.randint(0, out, (spec.batch,), generator=generator)
        if loss in ("mse", "bce"):
            made["target"] = torch.rand(spec.batch, out, generator=generator)
        if spec["head"] == "pool_masked_mean":
            made["attention_mask"] = _padding_mask(shape, generator)
        return made
    labels = torch.randint(0, out, shape, generator=generator)
    if spec["ignore_index"] == "scattered":
        labels[torch.rand(shape, generator=generator) < 0.25] = -100
        labels[:, -1] = torch.randint(0, out, (spec.batch,), generator=generator)  # never all ignored
    elif spec["ignore_index"] == "tail":
        labels[:, -IGNORED_TAIL:] = -100
    made["labels"] = labels
    if loss == "mse":
        made["target"] = torch.randn(*shape, out, generator=generator)
    if loss == "weighted":
        made["weights"] = torch.rand(shape, generator=generator)
    if loss == "masked_mean":
        made["loss_mask"] = (torch.rand(shape, generator=generator) < 0.6).float()
        made["loss_mask"][:, -1] = 1.0
    return made


def _padding_mask(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """1 for tokens, 0 for right padding: each sequence keeps at least one token."""
    batch_size, length = shape
    kept = torch.randint(1, length + 1, (batch_size,), generator=generator)
    return (torch.arange(length)[None, :] < kept[:, None]).long()


def build(spec: Spec, seed: int) -> tuple[torch.nn.Module, dict[str, torch.Tensor], str]:
    """The case's module (parameters seeded by ``seed``), its batch, and its source.

    The source is registered with ``linecache`` under a name of its own, so Dynamo and the SP pass's
    refusals can quote its lines as they quote a user's file.
    """
    text = source(spec)
    filename = f"<fuzz case {seed}>"
    linecache.cache[filename] = (len(text), None, text.splitlines(keepends=True), filename)
    namespace: dict[str, Any] = {}
    exec(compile(text, filename, "exec"), namespace)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        module = namespace["Case"]()
    return module, batch(spec, seed), text
