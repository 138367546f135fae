"""The record holders' recipe as a baseline: ALST (Arctic Long Sequence Training, DeepSpeed + ArcticTraining).

ALST trains Llama-8B at 500K tokens on one H100 with hand-written Ulysses and four memory levers, built
here as its code builds them, from DeepSpeed's own classes (``deepspeed.runtime.sequence_parallel``):

1. Ulysses attention: DeepSpeed's ``DistributedAttention`` in every layer (``models.build(...,
   "ulysses")``, the ``ulysses`` method's model);
2. every layer checkpointed: only a layer's input is kept, and backward runs the layer's forward again,
   attention and its all-to-alls included (HF's ``gradient_checkpointing_enable`` with
   ``use_reentrant=False`` for Llama, as ArcticTraining turns it on; ``torch.utils.checkpoint`` on each
   block of the hand-written GPT);
3. ``TiledMLP``: each MLP over ``ceil(tokens / hidden)`` tiles of this rank's tokens, recomputed tile by
   tile in backward (ALST's own number of tiles);
4. ``TiledFusedLogitsLoss``: the LM head and the loss over tiles of tokens, backward inside forward, so
   the whole logits never exist; tiles of at most ``LOGITS_TILE_ELEMENTS`` logits, the budget this
   project's chunked loss uses.

Left out on both sides: offload of the checkpoints and of ZeRO-3's parameters and optimizer state to
host memory, which has nothing to move on a CPU. ALST runs eagerly, as ArcticTraining does:
``TiledFusedLogitsLoss`` runs its backward inside forward, which ``torch.compile`` cannot trace.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn

from benchmarks.models import IGNORE_INDEX, ModelSpec, build

LOGITS_TILE_ELEMENTS = 2**26


def _tiled_mlp(mlp: nn.Module, hidden: int) -> None:
    """Run ``mlp`` over ``ceil(tokens / hidden)`` tiles of tokens with DeepSpeed's ``TiledMLP``.

    The MLP's ``forward`` is replaced on the instance, as ALST replaces ``LlamaMLP.forward`` (on the
    class): a wrapper module would rename the parameters that parity compares by name."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

    forward = mlp.forward  # the module's own computation, called on each tile

    def tiled(x: Tensor) -> Tensor:
        tiles = max(1, math.ceil(x.shape[-2] / hidden))
        return TiledMLP.apply(lambda _, tile: forward(tile), mlp, x, tiles, list(mlp.parameters()))

    mlp.forward = tiled


def alst_model(spec: ModelSpec, group: Any) -> nn.Module:
    """The ``ulysses`` method's model with every layer checkpointed and every MLP tiled."""
    model = build(spec, "ulysses", group)
    if spec.family == "gpt":  # its blocks are checkpointed where they are called (_hidden_states)
        for block in model.blocks:
            _tiled_mlp(block.mlp, spec.hidden)
        return model
    for layer in model.model.layers:
        _tiled_mlp(layer.mlp, spec.hidden)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model


def _hidden_states(spec: ModelSpec, model: nn.Module, ids: Tensor, positions: Tensor) -> Tensor:
    if spec.family == "gpt":
        x = model.wte(ids) + model.wpe(positions)
        for block in model.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        return model.ln_f(x)
    return model.model(input_ids=ids, position_ids=positions).last_hidden_state


def alst_loss(spec: ModelSpec, model: nn.Module) -> Callable[[Tensor, Tensor, Tensor, int], Tensor]:
    """As ``models.sharded_loss`` (this rank's share of the mean loss over all ranks' targets), with the LM
    head and the loss tiled by DeepSpeed's ``TiledFusedLogitsLoss``."""
    from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss

    head = model.lm_head

    def step(ids: Tensor, positions: Tensor, targets: Tensor, n_targets: int) -> Tensor:
        def tile_loss(_: nn.Module, x: Tensor, y: Tensor) -> Tensor:
            # The share of the mean is taken here, not after: the function runs the head's backward inside
            # its forward, with an incoming gradient of 1, so a division after it would miss the head.
            logits = head(x).float()  # HF's own loss upcasts the logits too
            total = F.cross_entropy(
                logits.reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            return total / n_targets

        hidden = _hidden_states(spec, model, ids, positions)
        tiles = max(1, math.ceil(hidden.shape[0] * hidden.shape[1] * spec.vocab_size / LOGITS_TILE_ELEMENTS))
        return TiledFusedLogitsLoss.apply(
            tile_loss, head, hidden, targets, None, tiles, list(head.parameters()), "sum"
        )

    return step
