"""What the sequence-layout analysis decides, as typed records that lowering executes.

A rule (``rules/``) returns its op's output layout, or a ``Decision``: that layout and the rewrites
lowering runs for the op (a family name, or a record with what the rewrite needs: a ``ConvolutionWindow``,
an ``AttentionCall``...). ``Analysis`` (``analysis.py``) records each decision in one ``Plan`` per graph,
beside the moves of values between layouts (``Redistribution``, Note [Redistribution] in
``analysis.py``) and the ``Refusal`` of anything it cannot prove exact. The rewrite families read these
records and re-derive nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import sympy
import torch
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import meta_value, op_name, source_line
from lightning_autosp.compiler.prove.layout import Layout


class SequenceParallelRefusal(NotImplementedError):
    """The SP pass cannot prove a step exact under sequence parallelism, so it refuses to run it: the message
    lists each op with the user's source line and a fix. Raised on every rank alike, before any collective
    of the step (Note [Ranks agree on their graphs]); a NotImplementedError, as an unsupported program is."""


class LengthBranchRefusal(SequenceParallelRefusal):
    """A refusal caused by the step's Python taking another branch on this rank's length than on the whole
    sequence's: traced at the whole sequence's length, the step may be exact (``trace_length="auto"``
    traces it so; Note [Tracing at the whole sequence's length] in ``whole_sequence.py``)."""


@dataclass(frozen=True)
class Refusal:
    node: fx.Node | None
    reason: str
    fix: str
    where: str | None = None  # instead of the node's op and source line
    length_branch: bool = False  # a branch on this rank's length (LengthBranchRefusal)

    def __str__(self) -> str:
        where = self.where or f"{op_name(self.node)} at {source_line(self.node)}"
        return f"- {where}: {self.reason}. {self.fix}"


Move = Literal["all_to_all", "all_reduce", "all_gather", "recompute", "narrow"]


@dataclass(frozen=True)
class Redistribution:
    """``user`` needs ``value`` in layout ``target`` (Note [Redistribution])."""

    value: fx.Node
    user: fx.Node
    source: Layout
    target: Layout
    via: Move

    @property
    def collective(self) -> str:
        return {
            "all_to_all": "all-to-all",
            "all_reduce": "all-reduce",
            "all_gather": "all-gather of its blocks",
            "recompute": "all-gather of its token inputs (recomputed whole)",
            "narrow": "none (this rank's block, cut locally)",
        }[self.via]

    def bytes(self) -> int:
        """What this rank holds of the value before the move (the all-to-all sends (P-1)/P of it)."""
        value = meta_value(self.value)
        if not isinstance(value, torch.Tensor):
            return 0
        return math.prod(symbols.hint(size) or 1 for size in value.shape) * value.element_size()

    def __str__(self) -> str:
        return (
            f"{self.value.name} {self.source} -> {self.target} for {op_name(self.user)} at "
            f"{source_line(self.user)}: {self.collective}, {self.bytes()} bytes"
        )


@dataclass(frozen=True)
class ConvolutionWindow:
    """A stride-1 convolution along the sequence run on the output positions this rank owns, from a window
    of its input with the neighbouring shards' boundary rows (Note [Windows of the sequence] in ops.py)."""

    dim: int  # the input's sequence dim
    spatial: int  # its index among the convolution's spatial dims
    pad_before: int  # zeros the convolution puts before the sequence
    pad_after: int  # and after it
    extent: int  # dilation * (kernel - 1): how many more inputs than outputs a window holds

    def output_length(self, length: object) -> object:
        """Output positions of the convolution over ``length`` input positions (int or SymInt)."""
        return length + self.pad_before + self.pad_after - self.extent

    def window(self, first: object, stop: object) -> tuple[object, object]:
        """The input positions ``[start, stop)`` that outputs ``[first, stop)`` read."""
        return first - self.pad_before, stop - self.pad_before + self.extent


@dataclass(frozen=True)
class TokenInsertion:
    """Replicated tokens joined to a sharded sequence at its start or end (``cat([prefix, x, suffix])``
    along it): this rank's positions of the longer sequence, from a window of ``x`` with the prefix and
    suffix in place of zeros (Note [Windows of the sequence] in ops.py)."""

    dim: int
    index: int  # the sharded operand's place among the joined tensors
    before: int  # positions the tensors before it add
    after: int  # and those after it


@dataclass
class FlashMatch:
    """One flash-attn call (``flash.py``): ``operands`` are the graph values the op reads, by its argument
    names."""

    node: fx.Node  # autograd_function_apply, or the forward op itself under no_grad
    op: fx.Node  # the forward op (inside fwd_body when ``node`` is autograd_function_apply)
    arguments: dict[str, object]  # the op's arguments by name, defaults filled in
    operands: dict[str, fx.Node]  # tensor arguments, as values of the outer graph
    output: fx.Node  # the outer value holding the attention output
    layout: str  # "BSHD" (flash_attn_func) or "SHD" (flash_attn_varlen_func)

    @property
    def head_dim(self) -> int:
        return self.layout.index("H")

    @property
    def seq_dim(self) -> int:
        return self.layout.index("S")

    @property
    def name(self) -> str:
        return self.node.name


@dataclass(frozen=True)
class AttentionCall:
    """An SDPA call proven exact, its arguments bound once by its rule (``rules/products.py``): lowering
    reads these instead of parsing the call again."""

    query: fx.Node
    key: fx.Node
    value: fx.Node
    mask: object  # a node, or None
    dropout_p: object
    is_causal: bool
    scale: object
    enable_gqa: bool
    heads: int  # of q, which the all-to-all splits over the Ulysses degree
    length: sympy.Expr | None = None  # the sequence's length where derived from the batch's (else None)


# Rewrites that need nothing but the op: the name of the ``Plan`` field lowering reads them from.
Family = Literal[
    "positions",
    "tables",
    "slices",
    "reductions",
    "extrema",
    "losses",
    "selections",
    "split_shapes",
    "global_shapes",
]


@dataclass(frozen=True)
class SplitConvolution:
    """A grouped convolution over channels split across the ranks: it runs ``groups`` groups here."""

    groups: int


Rewrite = Family | SplitConvolution | ConvolutionWindow | TokenInsertion | AttentionCall | FlashMatch


@dataclass(frozen=True)
class Decision:
    """What a rule decides for its op: the output's layout (a tuple of them for an op with several
    outputs) and the rewrites lowering runs for it."""

    layout: object
    rewrites: tuple[Rewrite, ...] = ()


# What a rule returns: its op's output layout (a tuple of them for several outputs), or a Decision.
Decided = Layout | tuple[Layout, ...] | Decision


def decide(layout: object, *rewrites: Rewrite) -> Decision:
    return Decision(layout, rewrites)


def layout_of(decided: object) -> object:
    """The output layout of what a rule returned (a layout, or a ``Decision``)."""
    return decided.layout if isinstance(decided, Decision) else decided


def relayout(decided: object, layout: object, *rewrites: Rewrite) -> Decision:
    """A rule's result ``decided`` with its output layout replaced by ``layout``, its rewrites kept and
    ``rewrites`` added (a rule that builds on another's decision)."""
    kept = decided.rewrites if isinstance(decided, Decision) else ()
    return Decision(layout, (*kept, *rewrites))


@dataclass
class Plan:
    """What the rewrite families change, node by node; the analysis records the rules' decisions here."""

    attention: dict[fx.Node, AttentionCall | FlashMatch] = field(default_factory=dict)  # SDPA, flash-attn
    positions: list[fx.Node] = field(default_factory=list)  # arange(S_r) -> this rank's positions
    tables: list[fx.Node] = field(default_factory=list)  # table[:S_r] -> rows at this rank's positions
    slices: list[fx.Node] = field(default_factory=list)  # slices / narrows / right pads along the sequence
    recompute: list[fx.Node] = field(default_factory=list)  # token data mixed along the sequence
    reductions: list[fx.Node] = field(default_factory=list)  # means over the sequence -> sum / global count
    extrema: list[fx.Node] = field(default_factory=list)  # amax / amin over the sequence -> all-reduce
    losses: list[fx.Node] = field(default_factory=list)  # cross_entropy / nll_loss mean -> global mean
    redistributions: list[Redistribution] = field(default_factory=list)  # Note [Redistribution]
    split_shapes: dict[fx.Node, None] = field(default_factory=dict)  # views of split values: local sizes
    selections: list[fx.Node] = field(default_factory=list)  # positions picked along the sequence -> partial
    split_convolutions: dict[fx.Node, int] = field(default_factory=dict)  # -> its groups on this rank
    value_sizes: dict[tuple[fx.Node, fx.Node], None] = field(default_factory=dict)  # (user, size) as values
    global_shapes: dict[fx.Node, None] = field(default_factory=dict)  # ops on global values: sizes at S
    windows: dict[fx.Node, ConvolutionWindow] = field(default_factory=dict)  # convolutions along it
    insertions: dict[fx.Node, TokenInsertion] = field(default_factory=dict)  # tokens joined to it

    def record(self, node: fx.Node, rewrite: Rewrite) -> None:
        """Record one rewrite a rule decided for ``node``."""
        if isinstance(rewrite, str):
            family = getattr(self, rewrite)
            if isinstance(family, dict):
                family[node] = None
            else:
                family.append(node)
        elif isinstance(rewrite, SplitConvolution):
            self.split_convolutions[node] = rewrite.groups
        elif isinstance(rewrite, ConvolutionWindow):
            self.windows[node] = rewrite
        elif isinstance(rewrite, TokenInsertion):
            self.insertions[node] = rewrite
        elif isinstance(rewrite, (AttentionCall, FlashMatch)):
            self.attention[node] = rewrite
        else:
            raise TypeError(f"no rewrite family for {rewrite!r}")

    def traffic(self) -> tuple[int, int]:
        """(collectives, bytes this rank holds of what they move) of the moves and windows, at the traced
        lengths (Note [Windows or blocks] in sp_pass.py)."""
        moves = [move for move in self.redistributions if move.via in ("all_to_all", "all_reduce")]
        window_bytes = 0
        for node, window in self.windows.items():
            value = meta_value(node.args[0])
            held = math.prod(symbols.hint(size) or 1 for size in value.shape) * value.element_size()
            window_bytes += held // (symbols.hint(value.shape[window.dim]) or 1) * window.extent
        return len(moves) + len(self.windows), sum(move.bytes() for move in moves) + window_bytes
