"""What sequence parallelism sends and holds per rank, and what the sending costs against compute: the
Ulysses all-to-alls and ring attention's K/V passing (``compiler/runtime/ring.py``).

An sp group of P ranks is U Ulysses ranks x R ring ranks (``AutoSPStrategy(ulysses_degree=...)``;
without a ring U = P, R = 1). Each rank holds T = B * S / P tokens of the residual stream; around
attention it holds S / R tokens of H / U q heads (``kv_heads_at_attention(U) / U`` K/V heads), which is
again T * (H * D) elements of q, and T * h_kv of K and of V, with h_kv = kv_heads_at_attention(U) * D.

Note [Ring attention costs]
    Per layer, each rank of a ring of R (``compiler/runtime/ring.py``):

    - sends: in forward, its K/V block passes R - 1 hops: (R - 1) * 2 * T * h_kv elements in the
      attention dtype (= 2 * S * h_kv_rank * (R - 1) / R for one sequence); in backward, K/V go around
      again (R - 1 hops) and dK/dV travel with them in fp32 (R hops: the last brings them home). SAC
      never recomputes ring attention, so these are the step's ring bytes.
    - holds while attention runs, besides what is saved for backward (K/V blocks in flight: the one in
      use, its packed copy being sent and the one being received; never an S x S matrix): in forward
      the fp32 output accumulator, a block's fp32 output and the merge's temporary (3 x T * H * D * 4)
      and 3 K/V blocks; in backward the fp32 dq accumulator and a block's dq, 3 K/V blocks and 3 fp32
      dK/dV blocks (accumulating, being sent, being received) and a block's dK/dV. The planner counts
      the larger of the two as ``ring_buffers``, on top of a layer's backward workspace.

    The ring's sends overlap the block computations (each hop is started before the block in hand is
    computed); :func:`planning.cli.comm_share` counts them as if they did not, an upper bound. A ring step
    waits for its slowest hop, so a ring that spans nodes runs at the network's rate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lightning_autosp.mesh import auto_ulysses_degree
from lightning_autosp.planning.model_shapes import ModelShape

UlyssesDegree = int | Literal["auto"] | None


@dataclass(frozen=True)
class SPLayout:
    """An sp group of ``sp_size`` ranks: ``ulysses_degree`` of them exchange heads, the rest is the ring."""

    sp_size: int
    ulysses_degree: int

    @property
    def ring_degree(self) -> int:
        return self.sp_size // self.ulysses_degree

    def describe(self) -> str:
        if self.ring_degree == 1:
            return str(self.sp_size)
        return f"{self.sp_size} (ulysses {self.ulysses_degree} x ring {self.ring_degree})"


def sp_layout(sp_size: int, heads: int, gpus_per_node: int, ulysses_degree: UlyssesDegree) -> SPLayout | None:
    """The layout ``AutoSPStrategy(sp_size, ulysses_degree=...)`` runs, or None where it refuses one.

    None (the default) is all Ulysses (U = sp, which must divide the heads); "auto" the largest U
    dividing sp, the heads and the GPUs per node (``mesh.auto_ulysses_degree``); an int, that U.
    """
    if ulysses_degree is None:
        degree = sp_size
    elif ulysses_degree == "auto":
        degree = auto_ulysses_degree(sp_size, heads, gpus_per_node)
    else:
        degree = ulysses_degree
    if sp_size % degree or heads % degree:
        return None
    return SPLayout(sp_size, degree)


@dataclass(frozen=True)
class _Widths:
    tokens: float  # T = B * S / P
    q: int  # H * D
    kv: int  # h_kv at attention
    x: int  # bytes of the attention dtype


def _widths(shape: ModelShape, layout: SPLayout, seq_len: int, batch_size: int, act_bytes: int) -> _Widths:
    kv_width = shape.kv_heads_at_attention(layout.ulysses_degree) * shape.d
    return _Widths(batch_size * seq_len // layout.sp_size, shape.attention_width, kv_width, act_bytes)


def a2a_bytes(shape: ModelShape, layout: SPLayout, seq_len: int, batch_size: int, act_bytes: int) -> int:
    """Bytes each rank sends through the Ulysses all-to-alls in one step (forward + backward).

    Per layer and direction T * ((U-1)/U) * (2h + 2h_kv) elements: q, k, v out and the attention
    output back; backward sends their gradients. SAC never recomputes a collective.
    """
    U = layout.ulysses_degree
    if U == 1:
        return 0
    w = _widths(shape, layout, seq_len, batch_size, act_bytes)
    per_token = (2 * w.q + 2 * w.kv) * w.x
    return round(2 * shape.layers * w.tokens * (U - 1) / U * per_token)


def ring_bytes(shape: ModelShape, layout: SPLayout, seq_len: int, batch_size: int, act_bytes: int) -> int:
    """Bytes each rank sends around the ring in one step, forward + backward (Note [Ring attention costs])."""
    R = layout.ring_degree
    if R == 1:
        return 0
    w = _widths(shape, layout, seq_len, batch_size, act_bytes)
    kv = 2 * w.tokens * w.kv  # this rank's K and V block, elements
    forward = (R - 1) * kv * w.x
    backward = (R - 1) * kv * w.x + R * kv * 4  # K/V again, and dK/dV in fp32 home
    return round(shape.layers * (forward + backward))


def ring_buffer_bytes(
    shape: ModelShape, layout: SPLayout, seq_len: int, batch_size: int, act_bytes: int
) -> int:
    """What one layer's ring attention holds while it runs, beyond the saved activations
    (Note [Ring attention costs])."""
    if layout.ring_degree == 1:
        return 0
    w = _widths(shape, layout, seq_len, batch_size, act_bytes)
    q, kv = w.tokens * w.q, 2 * w.tokens * w.kv
    forward = 3 * q * 4 + 3 * kv * w.x
    backward = q * (4 + w.x) + 3 * kv * (4 + w.x) + kv * w.x
    return round(max(forward, backward))


# --------------------------------------------------------------------------------------------------
# time


@dataclass(frozen=True)
class Throughput:
    """Assumptions behind the communication time estimate (H100/H200 SXM class)."""

    flops: float = 989e12  # dense bf16 peak
    mfu: float = 0.4  # share of the peak the step's compute reaches
    nvlink: float = 300e9  # bytes/s per GPU inside a node
    network: float = 40e9  # bytes/s per GPU between nodes (one 400 Gb/s NIC per GPU)


def step_flops(
    shape: ModelShape, seq_len: int, batch_size: int, sp_size: int, sac: bool, rebuild_attention: bool = False
) -> float:
    """FLOPs of one rank's step: matmuls (forward, backward, and SAC's recompute) and causal attention
    (forward 2*B*S^2*H*D per layer, backward 2.5x that, and the forward again where layers rebuild it),
    split over the sp ranks (zigzag balances a ring)."""
    T = batch_size * seq_len / sp_size
    linear = (6 + (2 if sac else 0)) * shape.matmul_weight_params * T
    passes = 4.5 if rebuild_attention else 3.5
    attention = passes * 2 * batch_size * seq_len**2 * shape.attention_width * shape.layers / sp_size
    return linear + attention


def comm_seconds(
    a2a: float, ring: float, layout: SPLayout, gpus_per_node: int, rates: Throughput = Throughput()
) -> float:
    """Seconds to send ``a2a`` all-to-all and ``ring`` ring bytes (not overlapped with compute).

    Of a rank's U - 1 all-to-all peers, those in other nodes are reached over the network, the rest
    over NVLink; ring steps wait for their slowest hop, over the network once the group spans nodes.
    """
    U = layout.ulysses_degree
    remote = max(0, U - gpus_per_node) / (U - 1) if U > 1 else 0.0
    seconds = a2a * ((1 - remote) / rates.nvlink + remote / rates.network)
    ring_rate = rates.network if layout.sp_size > gpus_per_node else rates.nvlink
    return seconds + ring / ring_rate
