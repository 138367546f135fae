"""Sequence layouts: where the elements of a value live relative to the sequence.

Note [Sequence layouts]
    Like DTensor's placements, but for one axis, the sequence, split over the P ranks of an sp group:

    - ``REPLICATE``: the same on every rank and nothing in it depends on which tokens a rank holds
      (parameters, constants, the loss once reduced).
    - ``shard(d, ...)``: dims ``d`` are indexed by this rank's tokens, and the local value is exactly
      this rank's part of the single-device value (after the pass's rewrites). Two dims make a
      pairwise value, like an [S_r, S_r] block of a mask.
    - ``PARTIAL``: a sum over this rank's tokens: the single-device value is the sum over ranks,
      which one all-reduce computes, where a consumer needs it (DTensor's ``Partial``).
    - ``global_(d, ...)``: dims ``d`` are indexed by all S tokens on every rank (a mask rebuilt for the
      whole sequence and handed to the next graph).
    - ``split(k, d, ...)``: dims ``d`` are indexed by all S tokens and dim ``k`` (heads, channels) is cut
      in P blocks, of which this rank holds block r: DTensor's ``Shard(k)`` where ``shard(d)`` is its
      ``Shard(seq)``. An op that mixes tokens but treats ``k`` independently (attention, a running sum,
      a flip, a depthwise convolution) runs on it exactly; an all-to-all moves a value between the two
      (Note [Redistribution] in ``analysis.py``).
    - ``CAUSAL``: a mask that is exactly causal, handed to the next graph as this tag; attention
      drops it for ``is_causal=True``.
    - ``rows(order)``, ``inverse(order)``, ``counts(order)``: this rank's tokens in another order, as a
      mixture of experts dispatches them (Note [Local token permutations] in ``rules/dispatch.py``).

    The analysis (``analysis.py``) gives every value of a graph a layout, from its inputs' layouts
    and one rule per op (``rules.py``); a value between graphs (a graph break, DDP's buckets) carries
    its layout as a tag on the tensor (``SequenceTags``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch
from torch.utils.weak import WeakTensorKeyDictionary

Kind = Literal[
    "replicate", "shard", "partial", "global", "split", "rows", "inverse", "counts", "causal", "refused"
]


@dataclass(frozen=True)
class Layout:
    """``dims``: the tensor dims indexed by tokens; ``flat``: those of them that also run over other dims
    (``[B, S_r, V] -> [B * S_r, V]``): per-token ops and reductions work on them, slices do not;
    ``flat_inner``: (dim, n) for a flat dim whose every token spans n consecutive elements of it (n = H for
    ``[B, S_r, H, D] -> [B * S_r * H, D]``), where the view that flattened it said so: what a view needs to
    tell the dims before the sequence from those after it when it un-flattens the dim again (Note [Views of
    flattened tokens] in ``rules/shapes.py``); ``split``: the dim cut in blocks over the ranks (kind
    ``"split"`` only)."""

    kind: Kind
    dims: tuple[int, ...] = ()
    flat: tuple[int, ...] = ()
    split: int | None = None
    # split only: (outer, inner) dims that index the tokens together, the sequence cut into chunks
    chunks: tuple[tuple[int, int], ...] = ()
    order: object = None  # rows / inverse / counts: the sort that ordered this rank's tokens
    # not part of the layout's identity: two values flattened alike compare equal whether or not it is known
    flat_inner: tuple[tuple[int, int], ...] = field(default=(), compare=False)

    @property
    def is_shard(self) -> bool:
        return self.kind == "shard"

    @property
    def is_split(self) -> bool:
        return self.kind == "split"

    @property
    def is_pairwise(self) -> bool:
        return self.kind in ("shard", "global") and len(self.dims) > 1

    def mapped(self, where: dict[int, int | None]) -> Layout:
        """This layout after its dims moved (``where[d]``: the new index of dim d; None: dim d is gone)."""
        dims = tuple(sorted(where[d] for d in self.dims if where.get(d) is not None))
        flat = tuple(sorted(where[d] for d in self.flat if where.get(d) is not None))
        if self.kind == "split":
            moved = where.get(self.split)
            chunks = tuple(
                (where[outer], where[inner])
                for outer, inner in self.chunks
                if where.get(outer) is not None and where.get(inner) is not None
            )
            return Layout("split", dims, flat, moved, chunks) if moved is not None else REFUSED
        if self.kind in ("rows", "inverse"):  # dim 0 runs over the tokens
            return self if where.get(0) == 0 else REFUSED
        if self.kind == "counts":
            return self
        if self.kind in ("shard", "global") and not dims:
            return REPLICATE
        inner = tuple(sorted((where[d], n) for d, n in self.flat_inner if where.get(d) in flat))
        return Layout(self.kind, dims, flat, flat_inner=inner)

    def __str__(self) -> str:
        if self.kind == "split":
            whole = f", whole sequence in {', '.join(map(str, self.dims))}" if self.dims else ""
            return f"split({self.split}{whole})"
        if self.kind in ("shard", "global"):
            return f"{self.kind}({', '.join(map(str, self.dims))})"
        if self.order is not None:
            return f"{self.kind}(by {getattr(self.order, 'name', self.order)})"
        return self.kind

    @property
    def is_local_order(self) -> bool:
        return self.kind in ("rows", "inverse", "counts")


REPLICATE = Layout("replicate")
PARTIAL = Layout("partial")
CAUSAL = Layout("causal")
# A value the analysis refused: its users are not judged again (the first refusal names the cause).
REFUSED = Layout("refused")


def shard(*dims: int, flat: tuple[int, ...] = (), flat_inner: tuple[tuple[int, int], ...] = ()) -> Layout:
    if not dims:
        return REPLICATE
    inner = tuple(sorted((d, n) for d, n in flat_inner if d in flat))
    return Layout("shard", tuple(sorted(dims)), tuple(sorted(flat)), flat_inner=inner)


def global_(*dims: int) -> Layout:
    return Layout("global", tuple(sorted(dims))) if dims else REPLICATE


def rows(order: object, kind: Kind = "rows") -> Layout:
    """This rank's tokens in the order ``order`` (a sort node) put them (Note [Sequence layouts])."""
    return Layout(kind, order=order)


def split(
    dim: int, *sequence_dims: int, flat: tuple[int, ...] = (), chunks: tuple[tuple[int, int], ...] = ()
) -> Layout:
    """Dim ``dim`` cut in blocks over the ranks, ``sequence_dims`` whole (Note [Sequence layouts])."""
    return Layout("split", tuple(sorted(sequence_dims)), tuple(sorted(flat)), dim, tuple(sorted(chunks)))


@dataclass(frozen=True)
class Tag:
    """A tensor's layout between graphs, with the global size of each of its sequence dims. ``whole``: the
    tensor holds the whole sequence, and the compiled graph takes this rank's part of it on entry
    (Note [Tracing at the whole sequence's length] in ``backend.py``)."""

    layout: Layout
    global_sizes: tuple[int, ...] = ()
    whole: bool = False


def _same_view(view: torch.Tensor, base: torch.Tensor) -> bool:
    return (
        view.shape == base.shape
        and view.stride() == base.stride()
        and view.storage_offset() == base.storage_offset()
        and view.dtype == base.dtype
    )


@dataclass
class SequenceTags:
    """The layouts of tensors that cross from one compiled graph (or the data layer) to the next.

    The strategy tags each sharded batch tensor; every compiled graph tags its outputs when it runs
    (for real, or on fake tensors while DDP compiles its buckets), so the next graph knows which of
    its inputs hold sequence shards without guessing from their sizes.
    """

    _tags: WeakTensorKeyDictionary = field(default_factory=WeakTensorKeyDictionary)

    def mark(self, tensor: torch.Tensor, tag: Tag) -> None:
        self._tags[tensor] = tag
        if tag.layout.is_shard and not isinstance(tensor, torch._subclasses.FakeTensor):
            # The next graph traces these dims as symbols (Note [Symbolic sequence lengths]).
            for dim in tag.layout.dims:
                torch._dynamo.maybe_mark_dynamic(tensor, dim)

    def get(self, tensor: object) -> Tag | None:
        """The tag of ``tensor``, or of the tensor it is a whole alias of (a custom ``autograd.Function``
        that returns its input, as FSDP2's post-forward hook does, hands on such a view)."""
        if not isinstance(tensor, torch.Tensor):
            return None
        tag = self._tags.get(tensor)
        base = tensor._base
        real = not isinstance(tensor, torch._subclasses.FakeTensor)  # comparing symbolic sizes would guard
        if tag is None and real and base is not None and _same_view(tensor, base):
            tag = self._tags.get(base)
        return tag

    def mark_batch(
        self, batch: object, sharded: list[tuple[torch.Tensor, int]], global_len: int, whole: bool = False
    ) -> None:
        """Tag a batch's tensors: ``sharded`` (tensor, sequence dim) hold this rank's slice of ``global_len``
        tokens along that dim (or all of them, ``whole``, for the compiled step to cut); every other
        tensor is replicated (the same on every rank of the sp group)."""
        from lightning.fabric.utilities.apply_func import apply_to_collection

        for tensor, dim in sharded:
            self.mark(tensor, Tag(shard(dim), (global_len,), whole))
        shards = {tensor for tensor, _ in sharded}  # tensors hash by identity
        replicated = lambda t: None if t in shards else self.mark(t, Tag(REPLICATE))  # noqa: E731
        apply_to_collection(batch, torch.Tensor, replicated)
