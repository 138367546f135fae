"""Per-rank memory of one training step under AutoSPStrategy, by component: parameters, gradients,
optimizer state, communication buffers, saved activations, mask, logits and layer workspace.

Shape letters: B micro-batch (per dp group), S global sequence, P sp ranks, T = B * ceil(S / P)
tokens per rank, L layers, h hidden, H heads, D head dim, h_kv = kv heads * D, I MLP width, V vocab,
N parameters, W = devices (dp x sp ranks).

Note [What is saved for backward]
    Counted tensor by tensor from the partitioned graphs of a 2-layer GPT and HF Llama (sp=1 and
    sp=2, fp32, bf16 and bf16-mixed; ``benchmarks/planner.py`` prints the list), per rank:

    - SAC on (``compiler/partition/sac.py``): per layer the attention's logsumexp (fp32) and its output
      [B, H/P, S, D], the latter only where no all-to-all brings it back (sp=1, ring attention: Note
      [Attention output by its row sums]); with P > 1 also the all-to-all outputs q, k, v
      [B, H/P, S, D] and the attention output back in sequence layout [B, S/P, h]; the residual
      stream at every block input but the first (rebuilt from the token ids) and at the final norm's
      input; the shifted labels. Everything else, the logits included, is recomputed in backward.
    - SAC off (PyTorch's min-cut): per layer the norm outputs and statistics, q, k, v, the attention
      output and logsumexp, the attention output in sequence layout, the residual after attention and
      after the MLP, and the MLP's matmul outputs (3 of width I for a gated MLP, 2 for a GELU one);
      once: the first block's input, rotary cos/sin, the final norm output, ``log_softmax`` of the
      logits (unless the loss is chunked), an explicit attention mask if the model builds one
      ([S, S], not divided by P) and, under autocast, the low-precision copies of the matmul weights.

    Dtypes under bf16-mixed: matmul outputs bf16, the residual stream fp32 (the embeddings are
    fp32). Rotary q and k come out fp32 (cos and sin are fp32); the SP pass casts them to bf16
    before the all-to-all, as attention would after it.

Note [Step peak]
    peak = max(params + optimizer + comm buffers + attention mask
               + max(saved activations + workspace, grads),              # forward and backward
               params + optimizer + DDP buckets + local grads
               + optimizer workspace)                                      # optimizer.step()
    Backward frees activations as it makes gradients (Lightning sets them to None between steps), so
    the step peaks either when backward starts (everything saved, plus the workspace) or when it
    ends (all gradients). That holds for Inductor, which frees each saved tensor after its last use;
    ``compiler="aot_eager"`` keeps them all until backward returns, so there the end of backward
    holds the saved activations and all gradients at once (the profiler puts the peak at 0.99 of the
    step). The workspace is the larger of the logits' (logits, their fp32 copy and
    gradient for T tokens, or for one chunk with the chunked loss) and one layer's backward: with
    SAC the layer rebuilt (what it would save without SAC, less q, k, v and the attention outputs,
    which SAC keeps), plus the gradients of the residual stream, of the MLP (three MLP-wide ones when
    a gated MLP is rebuilt), of the norms (fp32 under autocast) and of q, k, v; under Inductor the MLP's
    wide values are one tile's (:func:`mlp_tiles`, Note [Row tiling] in ``compiler/partition/tiling.py``).
    Against the allocator peaks of the trainability launches (real 2- and 4-rank groups; SAC, "longest"
    and SP alone; fp32 and bf16-mixed; ``benchmarks/planner_runs.py``) it errs from -10% to +13% at the
    longest length each budget search measured and from -33% to +29% at all lengths, where at short
    ones fixed buffers are a large share; pricing the MLP untiled there erred from -1% to +38%. Under
    ``aot_eager`` (priced untiled) against single-process peaks (``benchmarks/planner.py --peak``): -14%
    to +1% on 8-layer models. The saved activations, which dominate at scale, are within 7%.
    The optimizer step holds every local gradient at once, and its temporaries: the foreach
    implementation (PyTorch's default on GPU) makes a copy of all local parameters (AdamW's sqrt of the
    second moment), the for-loop one (the default on CPU) two of the largest, the fused one none.
    Whole Lightning training steps (a 44.6M-parameter Llama, 2 and 4 ranks, ``benchmarks/fsdp_memory.py``)
    come within -9% to 0% for "ddp" (whose peak is the optimizer step) and both "fsdp" modes.
    ``reserve`` (default 10% of the device) is left for the CUDA context, NCCL and fragmentation.
    With ``offload_activations`` the saved values are in host memory but for about two layers' worth
    (Note [Waiting for a copy to host] in ``compiler/partition/offload.py``); with ``offload_parameters``
    the shards, AdamW's state and the optimizer step are (``host_state``). Host memory is not checked.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal

from lightning_autosp.compiler.backend import Compiler
from lightning_autosp.compiler.partition.sac import DEFAULT_TILE_BYTES
from lightning_autosp.compiler.partition.tiling import MAX_TILES, tile_count
from lightning_autosp.fsdp import DataParallel, FSDPGather
from lightning_autosp.planning.model_shapes import ModelShape
from lightning_autosp.planning.sp_cost import SPLayout, a2a_bytes, ring_buffer_bytes, ring_bytes

OptimizerImpl = Literal["foreach", "for_loop", "fused"]
_PRECISIONS = {"32": "32-true", "bf16": "bf16-mixed", "16": "16-mixed"}
# A chunk of the chunked loss holds at most this many logits (compiler/lower/chunked_loss.py).
_LOGITS_CHUNK_ELEMENTS = 2**26


# --------------------------------------------------------------------------------------------------
# one setup


@dataclass(frozen=True)
class Setup:
    """One way to run the step: parallelism, recompute policy, precision and loss."""

    sp_size: int
    devices: int
    sac: bool = True
    # sac="longest": every layer keeps only its input and rebuilds attention and its all-to-alls too
    rebuild_attention: bool = False
    # offload_activations=True: saved values wait in host memory (Note [Activation offload])
    offload_activations: bool = False
    # offload_parameters=True (FSDP per step): the shards and AdamW's state on the host (CPUOffloadPolicy)
    offload_parameters: bool = False
    data_parallel: DataParallel = "ddp"
    precision: str = "bf16-mixed"
    batch_size: int = 1
    chunked_loss: bool = True
    loss_chunk_tokens: int | None = None
    optimizer_states: int = 2
    fsdp_gather: FSDPGather = "per_use"
    compiler: Compiler = "inductor"
    optimizer_impl: OptimizerImpl = "foreach"
    ulysses_degree: int | None = None  # of sp_size; the rest is ring attention (None: all Ulysses)
    # sac_tile_bytes: with SAC, a rebuilt MLP this wide runs over tiles of tokens (Note [Row tiling])
    tile_bytes: int | None = DEFAULT_TILE_BYTES

    def __post_init__(self) -> None:
        precision = _PRECISIONS.get(self.precision, self.precision)
        if precision not in ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"):
            raise ValueError(
                f"precision={self.precision!r} is not supported; use '32-true', 'bf16-mixed', '16-mixed', "
                "'bf16-true' or '16-true'."
            )
        object.__setattr__(self, "precision", precision)
        if self.data_parallel not in ("ddp", "fsdp"):
            raise ValueError(f"data_parallel={self.data_parallel!r} is not supported; use 'ddp' or 'fsdp'.")
        if self.sp_size < 1 or self.devices % self.sp_size:
            raise ValueError(f"sp_size={self.sp_size} must divide devices={self.devices}.")
        if self.offload_parameters and (self.data_parallel != "fsdp" or self.fsdp_gather != "per_step"):
            raise ValueError("offload_parameters needs data_parallel='fsdp' and fsdp_gather='per_step'.")
        if self.rebuild_attention and not self.sac:
            raise ValueError("rebuild_attention (sac='longest') is a SAC policy; it needs sac=True.")
        if self.sp_size % self.layout.ulysses_degree:
            raise ValueError(f"ulysses_degree={self.ulysses_degree} must divide sp_size={self.sp_size}.")

    @property
    def policy(self) -> str:
        """The ``sac`` option this setup stands for."""
        policy = "longest" if self.rebuild_attention else ("on" if self.sac else "off")
        return f"{policy} + offload" if self.offload_activations else policy

    @property
    def layout(self) -> SPLayout:
        return SPLayout(self.sp_size, self.ulysses_degree or self.sp_size)

    @property
    def dp_size(self) -> int:
        return self.devices // self.sp_size

    @property
    def mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def param_bytes(self) -> int:
        return 4 if self.precision == "32-true" or self.mixed else 2

    @property
    def act_bytes(self) -> int:
        """Matmul outputs and attention tensors."""
        return 4 if self.precision == "32-true" else 2


@dataclass(frozen=True)
class _Sizes:
    """Element counts and byte widths of one (shape, setup, seq_len)."""

    tokens: int  # T: this rank's tokens (the largest shard)
    head_tokens: int  # B * S / P: per-head-dim elements of q in head layout
    x: int  # matmul outputs
    r: int  # residual stream
    kv_width: int  # h_kv at attention

    @classmethod
    def of(cls, shape: ModelShape, setup: Setup, seq_len: int) -> _Sizes:
        P, B = setup.sp_size, setup.batch_size
        x = setup.act_bytes
        r = setup.param_bytes if setup.mixed else x
        return cls(
            tokens=B * math.ceil(seq_len / P),
            head_tokens=B * seq_len // P,
            x=x,
            r=r,
            kv_width=shape.kv_heads_at_attention(setup.layout.ulysses_degree) * shape.d,
        )


def mlp_tiles(shape: ModelShape, setup: Setup, seq_len: int) -> int:
    """The tiles SAC's row tiling runs a rebuilt MLP in (1: whole), as ``partition/tiling.choose_tiles``
    picks them: where its widest inner value [T, I] is at least ``tile_bytes`` and wider than its edges
    [T, h], tiles that bring it to half the edges' width, at most 8; with 16-bit matmuls none narrower
    than half of ``tile_bytes``. Priced under Inductor only: ``aot_eager`` runs the tiles too, but holds more
    of a graph's values until it returns, and its measured peaks match the untiled workspace (8-layer GPT
    and Llama, sp=2, 2,048 tokens: 32.6 and 26.4 MiB measured, 31.1 and 26.6 priced untiled, 28.4 and 22.1
    tiled)."""
    if not setup.sac or not setup.tile_bytes or setup.compiler != "inductor":
        return 1
    s = _Sizes.of(shape, setup, seq_len)
    inner, boundary = s.tokens * shape.intermediate * s.x, s.tokens * shape.hidden * s.x
    if inner < setup.tile_bytes or inner <= boundary:
        return 1
    return tile_count(inner, boundary, setup.tile_bytes, min(MAX_TILES, s.tokens), narrow=s.x < 4)


def _layer_without_sac(shape: ModelShape, s: _Sizes, tiles: int = 1) -> dict[str, int]:
    """What one layer saves under PyTorch's min-cut partitioner (also what SAC rebuilds in backward)."""
    T, h, q = s.tokens, shape.hidden, shape.attention_width
    stats = T * 4 * (2 if shape.norm == "layer" else 1)  # mean and rstd, or rsqrt
    return {
        "q, k, v": s.head_tokens * (q + 2 * s.kv_width) * s.x,
        # in head layout with its logsumexp, and in sequence layout (the output projection's input)
        "attention out + logsumexp": s.head_tokens * (q * s.x + shape.heads * 4) + T * q * s.x,
        "norms": 2 * (T * h * s.x + stats),
        "residual stream": 2 * T * h * s.r,  # after attention, after the MLP
        "MLP": (3 if shape.gated_mlp else 2) * math.ceil(T / tiles) * shape.intermediate * s.x,
    }


def saved_activations(shape: ModelShape, setup: Setup, seq_len: int) -> dict[str, int]:
    """Bytes this rank saves for backward, by kind (Note [What is saved for backward])."""
    s = _Sizes.of(shape, setup, seq_len)
    T, L, h, q = s.tokens, shape.layers, shape.hidden, shape.attention_width
    if setup.sac:
        # The first block's input (the embedding's output) is rebuilt in backward, unless that would
        # gather the sharded table again (data_parallel="fsdp", per use).
        gathers_table = setup.data_parallel == "fsdp" and setup.fsdp_gather == "per_use"
        block_inputs = (L if gathers_table else L - 1) * T * h * s.r
        if setup.rebuild_attention:  # only each block's input (Note [Layers that recompute attention])
            saved = {"block inputs": block_inputs, "final norm input": T * h * s.r}
            if setup.sp_size > 1:
                saved["labels"] = T * 8
            if shape.rotary:  # cos and sin, in fp32: every layer's rebuild reads them
                saved["rotary tables"] = 2 * T * shape.d * 4
            return saved
        saved = {"logsumexp": L * s.head_tokens * shape.heads * 4}
        # With all-to-alls around SDPA, backward takes the output's row sums instead of the output in
        # head layout (Note [Attention output by its row sums]); ring attention keeps its output.
        if setup.sp_size == 1 or setup.layout.ulysses_degree < setup.sp_size:
            saved["attention out"] = L * s.head_tokens * q * s.x
        if setup.sp_size > 1:
            saved["q, k, v after all-to-all"] = L * s.head_tokens * (q + 2 * s.kv_width) * s.x
            saved["attention out after all-to-all"] = L * T * q * s.x
            saved["labels"] = T * 8
        saved["block inputs"] = block_inputs
        saved["final norm input"] = T * h * s.r  # so the last block is rebuilt like the others
        return saved
    saved = {name: L * size for name, size in _layer_without_sac(shape, s).items()}
    stats = T * 4 * (2 if shape.norm == "layer" else 1)
    saved["norms"] += T * h * s.x + stats  # the final norm
    saved["residual stream"] += T * h * s.r  # the first block's input
    saved["positions"] = T * shape.d * 4 if shape.rotary else T * 8
    saved["labels"] = T * 8
    if not setup.chunked_loss:
        saved["log_softmax"] = T * shape.vocab * (4 if shape.loss_in_fp32 or setup.mixed else s.x)
    if setup.mixed:
        saved["bf16 weight copies"] = shape.matmul_weight_params * 2
    if _mask_bytes(shape, setup, seq_len):
        saved["attention mask"] = _mask_bytes(shape, setup, seq_len)
    return saved


def _mask_bytes(shape: ModelShape, setup: Setup, seq_len: int) -> int:
    """An explicit [B, 1, S, S] mask in the compute dtype (the SP pass drops a causal one)."""
    if not shape.attention_mask or setup.sp_size > 1:
        return 0
    return setup.batch_size * seq_len * seq_len * setup.act_bytes


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per rank at the step's peak, by component (Note [Step peak])."""

    params: int
    grads: int
    optimizer: int
    comm_buffers: int
    activations: int
    attention_mask: int
    logits_workspace: int
    layer_workspace: int
    ring_buffers: int = 0  # ring attention's K/V blocks in flight and fp32 accumulators (sp_cost.py)
    optimizer_workspace: int = 0
    optimizer_step: int = 0  # the optimizer step's own peak, all of it (Note [Step peak])
    activations_freed_in_backward: bool = True
    host_activations: int = 0  # saved values in host memory (offload_activations); not in the total
    host_state: int = 0  # parameter, gradient and optimizer shards in host memory (offload_parameters)

    @property
    def workspace(self) -> int:
        return max(self.logits_workspace, self.layer_workspace + self.ring_buffers)

    @property
    def forward_backward(self) -> int:
        """The peak of forward and backward (Note [Step peak])."""
        held = self.params + self.optimizer + self.comm_buffers + self.attention_mask
        at_backward_end = self.grads + (0 if self.activations_freed_in_backward else self.activations)
        return held + max(self.activations + self.workspace, at_backward_end)

    @property
    def total(self) -> int:
        """The step's peak: forward and backward, or the optimizer step (Note [Step peak])."""
        return max(self.forward_backward, self.optimizer_step)

    def items(self) -> list[tuple[str, int]]:
        """The components, and the total."""
        components = [f.name for f in fields(self) if f.type in (int, "int") and f.name != "optimizer_step"]
        return [(name, getattr(self, name)) for name in components] + [("total", self.total)]


def step_memory(shape: ModelShape, setup: Setup, seq_len: int) -> MemoryBreakdown:
    """Per-rank peak memory of one training step of ``seq_len`` tokens, by component."""
    s = _Sizes.of(shape, setup, seq_len)
    T, h, q, inner = s.tokens, shape.hidden, shape.attention_width, shape.intermediate
    N = shape.param_count
    pb = setup.param_bytes
    state = N * pb * setup.optimizer_states
    a2a_staging = 2 * s.head_tokens * q * s.x if setup.layout.ulysses_degree > 1 else 0
    if setup.data_parallel == "ddp":
        params, grads, optimizer = N * pb, N * pb, state
        dp_buffers = N * pb  # DDP's gradient buckets (gradient_as_bucket_view=False)
        local_grads, shards = grads, 1
    else:
        W = setup.devices
        # The all-gathered parameters alive at once, and their unsharded gradients before the
        # reduce-scatter (lightning_autosp/fsdp.py): per use, a layer's (if the compiler groups its
        # gathers) or the embedding / LM head, the largest single matrix; per step, the whole model.
        params, optimizer, local_grads, shards = N * pb // W, state // W, N * pb // W, W
        if setup.fsdp_gather == "per_step":
            grads, dp_buffers = local_grads + N * pb, N * pb
        else:
            # A gathered parameter and its unsharded gradient exist together, in its layer's backward.
            unit = max(shape.layer_params, shape.embedding_params)
            grads, dp_buffers = local_grads, 2 * unit * pb
    # optimizer.step() holds the local gradients, DDP's buckets and its temporaries (Note [Step peak])
    largest = max(shape.vocab * shape.hidden, shape.layer_matrix_params) * pb // shards
    optimizer_workspace = {"foreach": local_grads, "for_loop": 2 * largest, "fused": 0}[setup.optimizer_impl]
    ddp_buckets = dp_buffers if setup.data_parallel == "ddp" else 0
    host_state = 0
    if setup.offload_parameters:  # the shards live on the host, and the optimizer steps there
        host_state = params + optimizer + local_grads + optimizer_workspace
        params, optimizer, grads = 0, 0, grads - local_grads
        local_grads = optimizer_workspace = 0
    saved = saved_activations(shape, setup, seq_len)
    mask = _mask_bytes(shape, setup, seq_len)  # saved or rebuilt in backward: held once either way
    activations = sum(saved.values()) - saved.get("attention mask", 0)
    host_activations = 0
    if setup.offload_activations:
        # Note [Waiting for a copy to host]: a layer's saves leave while the next layer runs, and backward
        # brings one layer's back ahead of its use, so about two layers' saves are on the device at once.
        host_activations = activations
        activations = min(activations, 2 * math.ceil(activations / shape.layers))

    vocab_tokens = T * shape.vocab
    if setup.chunked_loss:
        chunk = setup.loss_chunk_tokens or max(1, _LOGITS_CHUNK_ELEMENTS // shape.vocab)
        vocab_tokens = min(T, chunk) * shape.vocab
    # The logits and their fp32 log_softmax (and its gradient): without SAC and chunking the
    # log_softmax is among the saved activations; otherwise it is made here, in backward.
    logits = vocab_tokens * (s.x + 4 + (4 if setup.sac or setup.chunked_loss else 0))

    # SAC rebuilds a layer in backward, but not what it keeps: q, k, v and the attention outputs are
    # among the saved activations already.
    kept_by_sac = () if setup.rebuild_attention else ("q, k, v", "attention out + logsumexp")
    tiles = mlp_tiles(shape, setup, seq_len)  # one tile's MLP-wide values at a time (Note [Row tiling])
    layer = _layer_without_sac(shape, s, tiles)
    rebuilt = {name: size for name, size in layer.items() if name not in kept_by_sac}
    recompute = sum(rebuilt.values()) if setup.sac else 0
    # Rebuilding a gated MLP in backward holds the gradients of both branches and of their product at
    # once (Inductor's backward graphs on CPU); with SAC off one MLP-wide gradient at a time.
    mlp_gradients = (3 if shape.gated_mlp and setup.sac else 1) * math.ceil(T / tiles) * inner * s.x
    # Norms run in fp32 under autocast (HF's RMSNorm upcasts; layer_norm is on autocast's fp32 list):
    # their backward holds an fp32 gradient and temporary the width of the residual stream.
    norm_gradients = 2 * T * h * 4 if setup.mixed else 0
    gradients = T * h * s.r + mlp_gradients + norm_gradients + s.head_tokens * (q + 2 * s.kv_width) * s.x
    return MemoryBreakdown(
        params=params,
        grads=grads,
        optimizer=optimizer,
        comm_buffers=dp_buffers + a2a_staging,
        activations=activations,
        attention_mask=mask,
        logits_workspace=logits,
        layer_workspace=recompute + gradients,
        ring_buffers=ring_buffer_bytes(shape, setup.layout, seq_len, setup.batch_size, setup.act_bytes),
        optimizer_workspace=optimizer_workspace,
        optimizer_step=params + optimizer + local_grads + optimizer_workspace + ddp_buckets,
        activations_freed_in_backward=setup.compiler == "inductor",
        host_activations=host_activations,
        host_state=host_state,
    )


def a2a_bytes_per_step(shape: ModelShape, setup: Setup, seq_len: int) -> int:
    """Bytes each rank sends through the Ulysses all-to-alls in one step (``sp_cost.a2a_bytes``); a layer
    rebuilding attention sends its forward all-to-alls again in backward."""
    sent = a2a_bytes(shape, setup.layout, seq_len, setup.batch_size, setup.act_bytes)
    return sent * 3 // 2 if setup.rebuild_attention else sent


def ring_bytes_per_step(shape: ModelShape, setup: Setup, seq_len: int) -> int:
    """Bytes each rank sends around the attention ring in one step (Note [Ring attention costs])."""
    return ring_bytes(shape, setup.layout, seq_len, setup.batch_size, setup.act_bytes)
