"""The sequence-layout analysis: every value of a graph gets a layout, every op on the sequence a rule.

Note [Proving a graph exact]
    Each rank's graph is traced on its own shard of the sequence, with the shard length as a symbol
    (Note [Symbolic sequence lengths] in ``symbols.py``). The analysis walks the graph once, in order,
    and gives every value a layout (Note [Sequence layouts] in ``layout.py``) from its inputs' layouts
    and the rule of its op (``rules/``), like DTensor's sharding propagation. A rule returns its op's
    output layout, or a ``Decision`` (``plan.py``): the layout and the rewrites lowering runs for the op.
    The analysis records each decision in the plan; no rule writes it. A rule does one of three things:

    - propagate: the op acts on other dims (pointwise, linear, norms over the hidden dim, softmax over
      the vocabulary, reshapes that keep the sequence dim), so the local result is this rank's part
      of the single-device result;
    - decide a rewrite that makes it so: attention (all-to-all), positions (``arange``, a table sliced
      by the length), slices and pads along the sequence, reductions over it (a sum becomes
      ``PARTIAL``; a mean, a sum over a global count), losses, and token data (integer inputs such as
      labels or positions) that an op mixes along the sequence (a ``cumsum``, ``roll``, ``diff``),
      which is computed for the whole sequence from the gathered inputs, then cut to this rank's part;
    - refuse: anything else that reads a sequence-sharded value along the sequence, and any op
      without a rule. The error names the op, the user's source line and the fix.

    Nothing is rewritten before the whole graph has been proven, and what lowering needs beyond each op's rule
    is checked right after (Note [Refusals before rewriting] in ``preconditions.py``); then the rewrite
    families (``sp_pass.py``) change exactly what the plan (``plan.py``) lists.

Note [Redistribution]
    A rule may state the layout it needs of an input (``Analysis.need``) instead of taking the one it
    gets, as DTensor's rules return the placements they accept and its propagator redistributes. The
    analysis records a ``Redistribution`` (the value, the op that needs it, from, to) and the rule goes on
    as if the input had that layout; ``redistribute.py`` inserts the move before that op:

    - ``shard(s) -> split(k, s)``: all-to-all. An op that mixes tokens but treats dim k independently
      (heads for attention written out, channels for a running sum, a flip, a depthwise convolution)
      runs on the whole sequence for 1/P of dim k. SDPA and flash-attn are this move around one op,
      with their own lowering (``attention.py``).
    - ``split(k, s) -> shard(s)``: the all-to-all back, where an op mixes along k (a projection).
    - ``partial -> replicate``: all-reduce, where an op is not linear in a sum over tokens.
    - ``shard -> global``: token data (masks, positions) computed for the whole sequence from the
      gathered per-token inputs (``recompute.py``).
    - ``replicate | global -> split(k)``: this rank's block of dim k, cut locally (a per-head bias).
    - ``shard(s)`` with a window: a convolution along the sequence (stride 1) reads, around this rank's
      positions, the neighbouring shards' boundary rows, which one all-to-all of those rows brings
      (``Plan.windows``; Note [Windows of the sequence] in ``ops.py``); so do replicated tokens joined to
      the sequence at its start or end, every shard shifted (``Plan.insertions``).

    Lowering re-derives nothing: every move is one record, and ``explain()`` lists each with its op,
    the user's source line, the collective and its bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sympy
import torch
from torch import fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import flatten, meta_value, op_name
from lightning_autosp.compiler.prove.flash import find_flash_attention
from lightning_autosp.compiler.prove.layout import (
    PARTIAL,
    REFUSED,
    REPLICATE,
    Layout,
    SequenceTags,
    Tag,
    shard,
)
from lightning_autosp.compiler.prove.plan import (
    Decision,
    LengthBranchRefusal,
    Plan,
    Redistribution,
    Refusal,
    SequenceParallelRefusal,
)
from lightning_autosp.compiler.prove.rules import dispatch, rule_for

log = logging.getLogger(__name__)


class Analysis:
    """Layouts and a plan for one graph (Note [Proving a graph exact]).

    Attributes the rules read and write:
        layouts: node -> Layout (or a tuple of them, for ops returning several tensors).
        sizes: node -> the expression of an int or float computed from a sequence length.
        token_data: nodes computed without parameters or gradients (from the batch's per-token inputs,
            sizes and constants): cheap to recompute for the whole sequence.
        lengths: each sequence symbol -> its global value.
    """

    def __init__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[object],
        context: SPContext,
        tags: SequenceTags,
        *,
        windows_first: bool = False,
    ) -> None:
        self.gm, self.context, self.tags = gm, context, tags
        # Convolutions along the sequence: a window before a block of groups (Note [Windows or blocks])
        self.windows_first = windows_first
        self.example_inputs = list(example_inputs)
        self.layouts: dict[fx.Node, object] = {}
        self.sizes: dict[fx.Node, sympy.Expr | tuple[sympy.Expr, ...]] = {}
        self.token_data: set[fx.Node] = set()
        self.plan = Plan()
        self.refusals: list[Refusal] = []
        self.errors: list[str] = []  # configuration errors (ValueError): the heads against the sp degree
        self.lengths: dict[sympy.Symbol, int] = {}
        self.input_tags: dict[fx.Node, Tag] = {}
        self.output_tags: list[Tag | None] = []
        self.output_nodes: list[object] = []
        self._shape_uses: set[fx.Node] = set()
        self._visiting: fx.Node | None = None
        self._needed: dict[fx.Node, Layout] = {}  # the layouts the visited op's rule asked for
        self._every_length: tuple[object, dict, dict] | None = None
        self._shape_env: object | None = None
        self._proven_lengths: dict[sympy.Expr, sympy.Expr] = {}  # sizes the guards prove are a length
        self.flash_matches = {match.node: match for match in find_flash_attention(gm, self.refuse)}

    # ---------------------------------------------------------------------------------------------
    # running

    def run(self) -> Analysis:
        placeholders = [n for n in self.gm.graph.nodes if n.op == "placeholder"]
        for node, example in zip(placeholders, self.example_inputs):
            self._classify_input(node, example)
        self._solve_lengths()
        for node in self.gm.graph.nodes:
            if node.op in ("call_function", "call_method"):
                self._visit(node)
            elif node.op == "get_attr":
                self.layouts[node] = REPLICATE
            elif node.op == "output":
                self._visit_output(node)
        return self

    def check_guards(self, shape_env: object, traced: int | None = None) -> None:
        """Refuse branches the model took on this rank's length that it would not take on the whole
        sequence (Note [Symbolic sequence lengths]); ``traced``: how many guards Dynamo recorded."""
        for guard, where in symbols.broken_guards(shape_env, self.lengths, traced):
            self.refusals.append(
                Refusal(
                    None,
                    f"the model branched on the sequence length ({guard}): that holds for this rank's "
                    f"{self.context.shard.local_len} tokens but not for the whole sequence of "
                    f"{self.context.shard.global_len}, which the single-device step would see",
                    "Trace the step at the whole sequence's length: AutoSPStrategy(trace_length='auto'), the "
                    "default, does so after this refusal, trace_length='whole' from the first step (one "
                    "compile per length); or make the branch independent of the length",
                    where=where,
                    length_branch=True,
                )
            )

    def raise_refusals(self) -> None:
        """Raise what the analysis found: refusals (SequenceParallelRefusal), then configuration errors."""
        if self.refusals:
            # A branch on the length is the cause of whatever else looks wrong at this rank's length.
            ordered = sorted(self.refusals, key=lambda refusal: refusal.node is not None)
            listed = "\n".join(dict.fromkeys(str(refusal) for refusal in ordered))
            branched = any(refusal.length_branch for refusal in self.refusals)
            raise (LengthBranchRefusal if branched else SequenceParallelRefusal)(
                "The SP pass cannot prove this training step exact under sequence parallelism, so it refuses "
                f"to run it (it never trains silently wrong):\n{listed}"
            )
        if self.errors:
            raise ValueError("\n".join(dict.fromkeys(self.errors)))

    # ---------------------------------------------------------------------------------------------
    # the API rules use

    def layout(self, arg: object) -> Layout:
        """The layout of an argument: a node's (as the visited op's rule needs it), or REPLICATE for a
        constant."""
        if not isinstance(arg, fx.Node):
            return REPLICATE
        if arg in self._needed:
            return self._needed[arg]
        layout = self.layouts.get(arg, REPLICATE)
        return layout if isinstance(layout, Layout) else REPLICATE

    def is_sequence_value(self, arg: object) -> bool:
        """Whether ``arg`` is anything but a replicated value: a sequence layout or a sequence size."""
        if not isinstance(arg, fx.Node):
            return False
        layout = self.layouts.get(arg, REPLICATE)
        if isinstance(layout, tuple):
            return any(isinstance(item, Layout) and item != REPLICATE for item in layout)
        return arg in self.sizes or layout != REPLICATE

    def size_expr(self, arg: object) -> sympy.Expr | None:
        """The expression of an int argument (a node computed from a length, or a constant)."""
        if isinstance(arg, fx.Node):
            expr = self.sizes.get(arg)
            return expr if isinstance(expr, sympy.Expr) else symbols.raw_expr(meta_value(arg))
        return symbols.raw_expr(arg)

    def shape(self, node: fx.Node) -> tuple[sympy.Expr, ...] | None:
        """The traced sizes of a tensor node, as expressions; a size the trace's guards prove equal to a
        length is that length's symbol, as rules compare sizes with lengths by identity."""
        value = meta_value(node)
        if isinstance(value, torch.Tensor):
            return tuple(self._as_length(expr) for expr in symbols.shape_exprs(value))
        return None

    def _as_length(self, expr: sympy.Expr) -> sympy.Expr:
        if not self.lengths:  # not solved yet (the inputs' layouts are being read)
            return expr
        if expr not in self._proven_lengths:
            if self._shape_env is None:
                self._shape_env = symbols.graph_shape_env(self.gm, self.example_inputs)
            # a graph of whole inputs is compiled for its traced length only (Note [Tracing at the whole
            # sequence's length]): there a size that takes the length's value is the length
            pinned = any(tag.whole for tag in self.input_tags.values())
            self._proven_lengths[expr] = symbols.as_length(self._shape_env, expr, self.lengths, pinned)
        return self._proven_lengths[expr]

    def has_sequence_symbol(self, expr: object) -> bool:
        if isinstance(expr, tuple):
            return any(self.has_sequence_symbol(e) for e in expr)
        return bool(symbols.symbols_of(expr) & set(self.lengths))

    def global_value(self, expr: sympy.Expr) -> int | torch.SymInt:
        """``expr`` at the global length: a number while analysing; once ``lower_for_every_length`` is
        set, a SymInt in this rank's shard symbols (Note [One graph for every length] in symbols.py)."""
        if self._every_length is None:
            return symbols.evaluate(expr, self.lengths)
        shape_env, substitution, hints = self._every_length
        return symbols.symint(shape_env, sympy.sympify(expr).subs(substitution), hints)

    @property
    def every_length(self) -> bool:
        """Whether the graph is being lowered for every length of its class."""
        return self._every_length is not None

    def lower_for_every_length(
        self, shape_env: object, substitution: dict[sympy.Symbol, sympy.Expr], hints: dict[sympy.Symbol, int]
    ) -> None:
        """From now on (lowering), global sizes are SymInts: ``substitution`` maps each sequence symbol
        to the global length in terms of this rank's shard symbol; ``hints``: the symbols' traced values."""
        self._every_length = (shape_env, substitution, hints)

    def shape_use(self, *args: object) -> None:
        """Declare size arguments of the op being visited as shapes (not values)."""
        for arg in flatten(list(args)):
            if isinstance(arg, fx.Node) and arg in self.sizes:
                self._shape_uses.add(arg)

    def refuse(self, node: fx.Node, reason: str, fix: str) -> Layout:
        self.refusals.append(Refusal(node, reason, fix))
        return REFUSED

    def mixes(self, node: fx.Node, what: str, out: object, fix: str) -> object:
        """``node`` mixes values along the sequence: token data is recomputed for the whole sequence,
        anything else (activations, which need gradients) is refused."""
        layouts = out if isinstance(out, tuple) else (out,)
        if node in self.token_data:
            if any(isinstance(x, Layout) and x.flat for x in layouts):
                self.refuse(node, f"{what} along a dim that flattens tokens with other dims", fix)
                return out
            self.plan.recompute.append(node)
            return out
        self.refuse(
            node, f"{what} along the sequence, over activations (values computed from parameters)", fix
        )
        return out

    def need(self, arg: fx.Node, target: Layout) -> Layout:
        """The visited op's rule needs ``arg`` in layout ``target`` (Note [Redistribution]); from here on
        ``layout(arg)`` answers ``target`` for this op."""
        source = self.layout(arg)
        if source == target:
            return target
        kinds = (source.kind, target.kind)
        if source == PARTIAL and target == REPLICATE:
            via = "all_reduce"
        elif source.kind == "split" and not source.dims and target == REPLICATE:
            via = "all_gather"
        elif kinds == ("split", "shard") or (kinds == ("shard", "split") and arg not in self.token_data):
            via = "all_to_all"
        elif source.kind == "shard" and target.kind in ("global", "split") and arg in self.token_data:
            via = "recompute"  # then cut to this rank's block of the split dim, if any
        elif source.kind in ("replicate", "global") and target.kind == "split":
            via = "narrow"
        else:
            raise AssertionError(f"no move from {source} to {target} for {arg.name}")
        self.plan.redistributions.append(Redistribution(arg, self._visiting, source, target, via))
        self._needed[arg] = target
        return target

    def sequence_home(self, arg: fx.Node) -> Layout:
        """A split value back to this rank's tokens (the all-to-all back), or a refusal where its
        sequence dim cannot be cut at the shard boundaries."""
        layout = self.layout(arg)
        shape = self.shape(arg)
        if layout.is_split and not layout.dims:  # no token left in it (a picked position): gather it whole
            return self.need(arg, REPLICATE)
        if len(layout.dims) != 1 or layout.flat or shape is None:
            return self.refuse(
                self._visiting,
                f"needs {arg.name} ({layout}) back in sequence shards, but its sequence dims are "
                f"{list(layout.dims)} (flattened: {list(layout.flat)})",
                "Keep one sequence dim, unflattened, where values go back to sequence shards",
            )
        return self.need(arg, shard(layout.dims[0]))

    def moved(self, arg: fx.Node) -> bool:
        """Whether the visited op's rule needs ``arg`` in another layout than it has."""
        return arg in self._needed

    def materialize(self, arg: object) -> None:
        """A consumer needs the whole value of a PARTIAL argument: one all-reduce makes it REPLICATE."""
        if isinstance(arg, fx.Node) and self.layout(arg) == PARTIAL:
            self.need(arg, REPLICATE)

    # ---------------------------------------------------------------------------------------------
    # inputs and outputs

    def _classify_input(self, node: fx.Node, example: object) -> None:
        value = meta_value(node)
        if isinstance(value, (torch.SymInt, torch.SymFloat)):
            self.sizes[node] = symbols.raw_expr(value)  # a sequence size if its symbol is one (below)
            self.token_data.add(node)
            return
        # DDP's buckets hand a graph fakes of its inputs: the tag is on Dynamo's own fake (the placeholder's
        # traced value), which every bucket of one trace shares.
        grapharg = node.meta.get("grapharg")
        real = getattr(grapharg, "example", None) if grapharg is not None else None
        tag = self.tags.get(example) or self.tags.get(real) or self.tags.get(value)
        if tag is not None and isinstance(value, torch.Tensor):
            self.tags.mark(value, tag)
        if tag is None:
            self.layouts[node] = REPLICATE
            if (
                isinstance(value, torch.Tensor)
                and not value.requires_grad
                and not _is_trainable(node, example)
            ):
                self.token_data.add(node)
            self._check_untagged_input(node, example)
            return
        self.input_tags[node] = tag
        self.layouts[node] = tag.layout
        if isinstance(value, torch.Tensor) and not value.requires_grad:
            self.token_data.add(node)

    def _check_untagged_input(self, node: fx.Node, example: object) -> None:
        """A tensor computed outside every compiled graph with a dim of a shard's length may hold sequence
        data that eager code computed without SP; the pass cannot tell, so it refuses. So does an untagged
        input with a symbolic dim: only sequence dims are traced as symbols."""
        if _is_parameter(node, example) or not isinstance(example, torch.Tensor):
            return
        lengths = set(self.context.shard.seq_lens) - {1}
        traced = meta_value(node)
        symbolic = isinstance(traced, torch.Tensor) and any(
            symbols.symbols_of(e) for e in symbols.shape_exprs(traced)
        )
        if symbolic or any(size in lengths for size in example.shape if isinstance(size, int)):
            self.refuse(
                node,
                f"the graph input {node.name} (shape {tuple(example.shape)}) was computed outside the "
                "compiled graphs (by code that ran eagerly: a frame Dynamo skipped after a graph break, or "
                "a module called through hooks, such as an FSDP unit the model shards itself) and has a "
                "dim of a shard's length, so it may hold sequence data computed without SP",
                "Remove the graph break before it (TORCH_LOGS=graph_breaks shows where); shard with "
                "AutoSPStrategy(data_parallel='fsdp') instead of fully_shard on submodules; or pass the "
                "tensor in the batch",
            )

    def _solve_lengths(self) -> None:
        """Each sequence symbol's global value, from the tagged inputs' sequence dims."""
        for node, tag in self.input_tags.items():
            shape = self.shape(node)
            if shape is None or not tag.layout.is_shard:
                continue
            for dim, global_size in zip(tag.layout.dims, tag.global_sizes):
                expr = shape[dim]
                free = symbols.symbols_of(expr)
                if len(free) != 1:
                    if not free:
                        self.refuse(
                            node,
                            f"the sequence dim {dim} of {node.name} was specialized to the constant {expr} "
                            "while tracing (e.g. int(x.size(1)), a Python loop over the length)",
                            "Keep sequence lengths symbolic: use sizes as tensors' shapes, not as "
                            "Python ints",
                        )
                    continue
                (symbol,) = free
                solutions = [s for s in sympy.solve(sympy.Eq(expr, global_size), symbol) if s.is_integer]
                if solutions:
                    self.lengths.setdefault(symbol, int(solutions[0]))
        # Sizes of other symbols (there are none unless something else was marked dynamic) are constants.
        self.sizes = {n: e for n, e in self.sizes.items() if self.has_sequence_symbol(e)}

    def _visit_output(self, node: fx.Node) -> None:
        self.output_nodes = flatten(list(node.args))
        self._visiting, self._needed = node, {}
        for value in self.output_nodes:
            if not isinstance(value, fx.Node):
                self.output_tags.append(None)
                continue
            self.materialize(value)
            if self.layout(value).is_split:  # the next graph gets this rank's tokens
                self.sequence_home(value)
            self.output_tags.append(self._tag(value, self.layout(value)))

    def _tag(self, node: fx.Node, layout: Layout) -> Tag:
        shape = self.shape(node)
        if layout.kind not in ("shard", "global") or shape is None:
            return Tag(layout)
        return Tag(layout, tuple(self.global_value(shape[d]) for d in layout.dims))

    # ---------------------------------------------------------------------------------------------
    # one node

    def _visit(self, node: fx.Node) -> None:
        value = meta_value(node)
        args = flatten([list(node.args), dict(node.kwargs)])
        self._inherit_token_data(node, args)
        if _is_scalar(value) or _is_shape(value):
            exprs = tuple(symbols.raw_expr(v) for v in value) if _is_shape(value) else symbols.raw_expr(value)
            if self.has_sequence_symbol(exprs):
                self.sizes[node] = exprs
            elif exprs is None:  # a length made a float (``0.0 + x.shape[0]``): the lengths are values
                for arg in args:
                    if isinstance(arg, fx.Node) and arg in self.sizes:
                        self.plan.value_sizes[(node, arg)] = None
            self.layouts[node] = REPLICATE
            return
        if not any(self.is_sequence_value(a) for a in args):
            self.layouts[node] = REPLICATE
            return
        if any(isinstance(a, fx.Node) and self.layouts.get(a) == REFUSED for a in args):
            self.layouts[node] = REFUSED
            return
        self._shape_uses = set()
        self._visiting, self._needed = node, {}
        rule = rule_for(node)
        if rule is None:
            self.layouts[node] = self.refuse(
                node,
                "no rule says how this op treats the sequence dim",
                "Write the step with ops the SP pass knows (README: Limits and errors), or open an "
                "issue with this op",
            )
            return
        if not getattr(rule, "handles_local_order", False) and any(
            isinstance(arg, fx.Node) and self.layout(arg).is_local_order for arg in args
        ):
            self.layouts[node] = self.refuse(
                node,
                "takes rows of this rank's tokens in a mixture of experts' order, which this op does not "
                "keep apart",
                dispatch.FIX,
            )
            return
        if not getattr(rule, "handles_split", False):
            # Its rule knows sequence shards only: split inputs come back to this rank's tokens first.
            for arg in args:
                if isinstance(arg, fx.Node) and self.layout(arg).is_split:
                    self.sequence_home(arg)
        decided = rule(self, node)
        if isinstance(decided, Decision):
            for rewrite in decided.rewrites:
                self.plan.record(node, rewrite)
            decided = decided.layout
        self.layouts[node] = decided
        if REFUSED in flatten([self.layouts[node]]) and not any(r.node is node for r in self.refusals):
            self.refuse(  # a layout the rule could not follow (a dim it tracks moved away): never silent
                node,
                f"moves a dim its input's layout tracks ({', '.join(str(self.layout(x)) for x in args)})",
                "Keep the sequence (or heads, or rows) dim in place around this op",
            )
        for arg in args:  # every sequence size not used as a shape is used as a value
            if isinstance(arg, fx.Node) and arg in self.sizes and arg not in self._shape_uses:
                self.plan.value_sizes[(node, arg)] = None
        if isinstance(self.layouts[node], Layout) and self.layouts[node].is_split:
            self.plan.global_shapes[node] = None  # its sequence is whole: sizes at the global length

    def _inherit_token_data(self, node: fx.Node, args: list[object]) -> None:
        """Token data: no gradient, and computed from token data only (no trainable parameter)."""
        requires_grad = any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in flatten([meta_value(node)])
        )
        if op_name(node) in _SHAPE_OPERAND_OPS:  # ``mask.expand_as(x)``: x gives a shape or dtype, no data
            args = [node.args[0]]
        inputs = [a for a in args if isinstance(a, fx.Node)]
        if not requires_grad and all(a in self.token_data for a in inputs):
            self.token_data.add(node)


# Ops whose second operand is read for its shape or dtype only.
_SHAPE_OPERAND_OPS = frozenset({"expand_as", "view_as", "reshape_as", "type_as"})


def _is_scalar(value: object) -> bool:
    return isinstance(value, (int, float, torch.SymInt, torch.SymFloat)) and not isinstance(value, bool)


def _is_shape(value: object) -> bool:
    return (
        isinstance(value, (tuple, list, torch.Size))
        and len(value) > 0
        and all(isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool) for v in value)
    )


def _is_trainable(node: fx.Node, example: object) -> bool:
    return isinstance(example, torch.nn.Parameter) and example.requires_grad


def _is_parameter(node: fx.Node, example: object) -> bool:
    """Parameters and buffers lifted into the graph as inputs are replicated, never sharded."""
    if isinstance(example, torch.nn.Parameter):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", "")
    name = name() if callable(name) else str(name)  # a method before torch 2.10, a property since
    return "_parameters" in name or "_buffers" in name
