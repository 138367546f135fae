"""Chunked LM head + cross-entropy: the loss over all tokens without materializing the logits.

At long context the vocabulary logits are the largest tensor of a step: [N, V] for N tokens (per
rank) and a vocabulary of V (128256 for Llama 3), i.e. 16 GiB in fp32 at 32K tokens, and a step holds
about three such buffers at once (the logits, ``log_softmax``'s output, their gradient). ``chunked_loss_pass``
finds ``linear(hidden, W[, b]) -> row-wise views/casts -> cross_entropy`` in a Dynamo graph and
replaces it by one custom op that computes the loss ``chunk_tokens`` rows at a time, and whose
backward recomputes each chunk's logits to accumulate the gradients of hidden, W and b. Peak memory
for the loss becomes about two [chunk_tokens, V] buffers instead of three [N, V] ones; what backward
keeps is the op's inputs.

Shape letters: N tokens (rows of the flattened hidden states), C hidden size, V vocabulary.

The pass runs after the SP pass (Note [Loss over sequence shards] in ``losses.py``): there the loss
is ``cross_entropy(..., reduction="sum")`` of this rank's tokens followed by an all-reduce, and the
op replaces the local cross-entropy only, so it composes with SP as it stands.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, fx

from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.fx_utils import bind, example_value
from lightning_autosp.compiler.fx_utils import call as _call

log = logging.getLogger(__name__)

# A chunk's logits hold at most this many elements (256 MiB in fp32): 523 tokens for Llama 3's
# 128256-token vocabulary, still hundreds of rows for each of the chunk's matmuls.
LOGITS_CHUNK_ELEMENTS = 2**26

_CROSS_ENTROPY_SIGNATURE = inspect.signature(F.cross_entropy)
_CASTS = {"float", "double", "half", "bfloat16", "to", "type", "contiguous"}


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per chunk when none is given: as many as keep a chunk's logits within 2**26 elements."""
    return max(1, LOGITS_CHUNK_ELEMENTS // vocab)


def token_chunks(tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` covering ``range(tokens)`` in steps of ``chunk_tokens``."""
    return [(start, min(start + chunk_tokens, tokens)) for start in range(0, tokens, chunk_tokens)]


@contextlib.contextmanager
def _autocast_off(device: torch.device) -> Iterator[None]:
    # The pass casts the op's inputs to the dtype autocast chose for the LM head, and the op does
    # the upcast itself: autocast must not cast again inside.
    with torch.autocast(device_type=device.type, enabled=False):
        yield


def _accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _valid_count(target: Tensor, ignore_index: int, dtype: torch.dtype) -> Tensor:
    return (target != ignore_index).sum(dtype=dtype)


@torch.library.custom_op("autosp_loss::linear_cross_entropy", mutates_args=())
def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_tokens: int,
    logits_dtype: torch.dtype,
) -> Tensor:
    """``cross_entropy(linear(hidden, weight, bias).to(logits_dtype), target)``, ``chunk_tokens`` rows
    at a time: hidden [N, C], weight [V, C], bias [V] or None, target [N] -> a scalar of ``logits_dtype``.

    The logits are computed in hidden's dtype (the model's, or autocast's) and upcast to
    ``logits_dtype`` before the softmax, as ``logits.float()`` in Hugging Face's loss does.
    ``reduction`` is "mean" (over targets != ignore_index) or "sum".
    """
    accumulator = _accumulator_dtype(logits_dtype)
    with _autocast_off(hidden.device):
        total = hidden.new_zeros((), dtype=accumulator)
        for start, stop in token_chunks(hidden.shape[0], chunk_tokens):
            logits = F.linear(hidden[start:stop], weight, bias).to(logits_dtype)  # [n, V]
            chunk_target = target[start:stop]
            valid = chunk_target != ignore_index
            # -log softmax(logits)[t] = logsumexp(logits) - logits[t]: no second [n, V] buffer
            picked = logits.gather(1, torch.where(valid, chunk_target, 0).unsqueeze(1)).squeeze(1)
            token_losses = torch.logsumexp(logits, dim=-1).to(accumulator) - picked.to(accumulator)
            total += token_losses.masked_fill(~valid, 0).sum()
        if reduction == "mean":
            total = total / _valid_count(target, ignore_index, accumulator)
    return total.to(logits_dtype)


@linear_cross_entropy.register_fake
def _(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_tokens: int,
    logits_dtype: torch.dtype,
) -> Tensor:
    return hidden.new_empty((), dtype=logits_dtype)


@torch.library.custom_op("autosp_loss::linear_cross_entropy_backward", mutates_args=())
def linear_cross_entropy_backward(
    grad: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_tokens: int,
    logits_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of ``linear_cross_entropy`` for hidden [N, C], weight [V, C] and bias [V] ([0]: no bias).

    Each chunk's logits are recomputed; d loss / d logits = scale * (softmax(logits) - onehot(target))
    on rows whose target is not ignore_index (scale: ``grad``, over the valid count for "mean"). The
    weight and bias gradients are summed over chunks in fp32 (or wider) and cast once at the end.
    """
    accumulator = _accumulator_dtype(logits_dtype)
    with _autocast_off(hidden.device):
        scale = grad.to(accumulator)
        if reduction == "mean":
            scale = scale / _valid_count(target, ignore_index, accumulator)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=_accumulator_dtype(weight.dtype), device=weight.device)
        grad_bias = (
            torch.zeros(bias.shape, dtype=_accumulator_dtype(bias.dtype), device=bias.device)
            if bias is not None
            else hidden.new_empty(0)
        )
        for start, stop in token_chunks(hidden.shape[0], chunk_tokens):
            rows, chunk_target = hidden[start:stop], target[start:stop]  # [n, C], [n]
            logits = F.linear(rows, weight, bias).to(logits_dtype)  # [n, V]
            grad_logits = logits.to(accumulator)  # the same buffer when the logits are fp32 already
            del logits
            # softmax in place: exp(logits - logsumexp(logits))
            grad_logits.sub_(torch.logsumexp(grad_logits, dim=-1, keepdim=True)).exp_()
            valid = chunk_target != ignore_index
            picked = torch.where(valid, chunk_target, 0)
            grad_logits[torch.arange(stop - start, device=rows.device), picked] -= valid.to(accumulator)
            grad_logits *= (valid * scale).unsqueeze(1)
            grad_logits = grad_logits.to(rows.dtype)  # backward of the upcast
            grad_hidden[start:stop] = grad_logits @ weight
            grad_weight += (grad_logits.t() @ rows).to(grad_weight.dtype)
            if bias is not None:
                grad_bias += grad_logits.sum(0, dtype=grad_bias.dtype)
    return (
        grad_hidden,
        grad_weight.to(weight.dtype),
        grad_bias.to(bias.dtype if bias is not None else hidden.dtype),
    )


@linear_cross_entropy_backward.register_fake
def _(
    grad: Tensor,
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    target: Tensor,
    ignore_index: int,
    reduction: str,
    chunk_tokens: int,
    logits_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_bias = torch.empty_like(bias) if bias is not None else hidden.new_empty(0)
    return torch.empty_like(hidden), torch.empty_like(weight), grad_bias


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, bias, target, *ctx.options = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(hidden, weight, bias, target)


def _backward(ctx, grad: Tensor):
    hidden, weight, bias, target = ctx.saved_tensors
    grad_hidden, grad_weight, grad_bias = linear_cross_entropy_backward(
        grad, hidden, weight, bias, target, *ctx.options
    )
    return grad_hidden, grad_weight, grad_bias if ctx.has_bias else None, None, None, None, None, None


linear_cross_entropy.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------------------------------
# The pass


@dataclass
class LossHeadMatch:
    """``cross_entropy(chain(linear(hidden, weight, bias)), target)`` with a row-wise ``chain``."""

    loss: fx.Node
    linear: fx.Node
    chain: list[fx.Node]  # from the linear's user to the cross_entropy's input, in graph order
    target: fx.Node
    ignore_index: int
    reduction: str

    @property
    def hidden(self) -> fx.Node:
        return self.linear.args[0]

    @property
    def weight(self) -> fx.Node:
        return self.linear.args[1]

    @property
    def bias(self) -> fx.Node | None:
        args = self.linear.args
        return args[2] if len(args) > 2 else self.linear.kwargs.get("bias")


@dataclass
class ChunkedLossReport:
    """What ``chunked_loss_pass`` did to one graph, for ``AutoSPStrategy.explain()`` and tests."""

    chunked: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        return [f"loss chunked: {item}" for item in self.chunked] + [
            f"loss not chunked: {item}" for item in self.skipped
        ]


def is_linear(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is F.linear


def _method_or_function_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.op == "call_function":
        return getattr(node.target, "__name__", "")
    return ""


def _is_full_slice(item: object) -> bool:
    return (
        isinstance(item, slice) and item.start in (None, 0) and item.stop is None and item.step in (None, 1)
    )


def _reshape_target(node: fx.Node) -> tuple[int, ...] | None:
    """The shape argument of a ``view``/``reshape`` node (None: not a plain tuple of ints)."""
    args = node.args[1:] or tuple(node.kwargs.values())
    shape = args[0] if len(args) == 1 and isinstance(args[0], (tuple, list, torch.Size)) else args
    return tuple(shape) if shape and all(type(size) is int for size in shape) else None


def _flatten_dims(node: fx.Node) -> tuple[int, int]:
    bound = inspect.signature(lambda start_dim=0, end_dim=-1: None).bind(*node.args[1:], **node.kwargs)
    bound.apply_defaults()
    return bound.arguments["start_dim"], bound.arguments["end_dim"]


def _keeps_vocab_rows(node: fx.Node, vocab: int) -> str | None:
    """None when ``node`` maps [..., V] logits to [..., V] logits row by row; else why not.

    Row-wise: a reshape that keeps the last dim (rows regroup, each row intact), an index or narrow
    off the last dim (selects rows), a dtype cast or ``contiguous`` (same rows).

    Decided from the node's arguments and its input's rank and vocabulary dim only: after the SP pass
    rewrote a shift, the fake values downstream still have the shapes of the original trace.
    """
    source = node.args[0] if node.args else None
    value, source_value = example_value(node), example_value(source)
    if value is None or source_value is None or value.dim() == 0 or source_value.dim() == 0:
        return f"{node.name} is not a tensor op"
    if source_value.shape[-1] != vocab:
        return f"{node.name} works on a tensor whose last dim is not the vocabulary"
    name = _method_or_function_name(node)
    ndim = source_value.dim()
    if node.op == "call_method" and name in _CASTS:
        moves = value.device != source_value.device
        return f"{node.name} moves the logits to another device" if moves else None
    if name in ("view", "reshape"):
        shape = _reshape_target(node)
        keeps_rows = shape is not None and shape[-1] == vocab and value.dtype == source_value.dtype
        return None if keeps_rows else f"{node.name} reshapes the vocabulary dim"
    if name == "flatten":
        start, end = _flatten_dims(node)
        return None if end % ndim != ndim - 1 else f"{node.name} flattens the vocabulary dim"
    if name == "narrow":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        return (
            None if isinstance(dim, int) and dim % ndim != ndim - 1 else f"{node.name} narrows the vocabulary"
        )
    if node.target is operator.getitem:
        index = node.args[1]
        items = index if isinstance(index, tuple) else (index,)
        if not all(item is None or item is Ellipsis or isinstance(item, (int, slice)) for item in items):
            return f"{node.name} indexes the logits with a tensor"
        indexed = [item for item in items if item is not None]
        if Ellipsis in indexed:
            after = indexed[indexed.index(Ellipsis) + 1 :]
            touches_last = bool(after) and not _is_full_slice(after[-1])
        else:
            touches_last = len(indexed) == ndim and not _is_full_slice(indexed[-1])
        return f"{node.name} indexes the vocabulary dim" if touches_last else None
    return f"{node.name} ({name or node.target}) is not a row-wise view or cast of the logits"


def _other_users(node: fx.Node, expected: fx.Node) -> list[str]:
    return [
        "the graph output (returned from the step, or needed after a graph break)"
        if user.op == "output"
        else user.name
        for user in node.users
        if user is not expected
    ]


def match_loss_head(loss: fx.Node) -> LossHeadMatch | str:
    """The LM head feeding ``loss`` (a ``cross_entropy`` node), or the reason it cannot be chunked."""
    args = bind(loss, _CROSS_ENTROPY_SIGNATURE)
    logits, target = args["input"], args["target"]
    if args["size_average"] is not None or args["reduce"] is not None:
        return "uses the deprecated size_average/reduce arguments"
    if args["reduction"] not in ("mean", "sum"):
        return f"reduction={args['reduction']!r} (only 'mean' and 'sum' are chunked)"
    if args["weight"] is not None or args["label_smoothing"] != 0.0:
        return "class weights or label smoothing are not chunked"
    logits_value, target_value = example_value(logits), example_value(target)
    if logits_value is None or logits_value.dim() != 2:
        return "its input is not a [tokens, vocab] matrix"
    if target_value is None or target_value.is_floating_point() or target_value.dim() != 1:
        return "its target is not a vector of class indices"
    vocab = logits_value.shape[-1]
    chain: list[fx.Node] = []
    node = logits
    while not is_linear(node):
        if node.op in ("placeholder", "get_attr"):
            return (
                f"its logits come from outside this graph ({node.name}; a graph break or a DDP bucket "
                "boundary between the LM head and the loss), so they are materialized anyway"
            )
        reason = _keeps_vocab_rows(node, vocab)
        if reason is not None:
            return reason
        chain.insert(0, node)
        node = node.args[0]
    weight = example_value(node.args[1])
    if weight is None or weight.dim() != 2 or weight.shape[0] != vocab:
        return f"the weight of {node.name} is not a [vocab, hidden] matrix"
    dtypes = [example_value(n).dtype for n in (node, *chain, loss)]
    changes = [d for d, previous in zip(dtypes[1:], dtypes) if d != previous]
    if len(changes) > 1:
        return f"the logits are cast more than once ({' -> '.join(str(d) for d in dtypes)})"
    for producer, consumer in zip([node, *chain], [*chain, loss]):
        others = _other_users(producer, consumer)
        if others:
            return (
                f"the logits ({producer.name}) are also used by {', '.join(others)}; chunking would still "
                "materialize them. Return or use only the loss to chunk it"
            )
    return LossHeadMatch(loss, node, chain, target, args["ignore_index"], args["reduction"])


def find_loss_heads(gm: fx.GraphModule) -> tuple[list[LossHeadMatch], list[str]]:
    """Every ``cross_entropy`` of the graph: the chunkable ones, and why the others are not."""
    matches, skipped = [], []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is F.cross_entropy:
            found = match_loss_head(node)
            if isinstance(found, LossHeadMatch):
                matches.append(found)
            else:
                skipped.append(f"{node.name}: {found}")
    return matches, skipped


def _rows_of_hidden(graph: fx.Graph, match: LossHeadMatch) -> fx.Node:
    """Apply the chain's row selection and regrouping to hidden: [..., C] -> [N, C]."""
    hidden = match.hidden
    width = example_value(hidden).shape[-1]
    for node in match.chain:
        name = _method_or_function_name(node)
        if node.op == "call_method" and name in _CASTS:
            continue  # the op upcasts to the loss's dtype itself
        if name in ("view", "reshape"):
            hidden = _call(graph, torch.reshape, (hidden, (*_reshape_target(node)[:-1], width)))
        elif name == "flatten":
            hidden = _call(graph, torch.flatten, (hidden, *_flatten_dims(node)))
        elif name == "narrow":
            hidden = _call(graph, torch.narrow, (hidden, *node.args[1:]), dict(node.kwargs))
        else:  # an index off the last dim selects the same rows of hidden
            hidden = _call(graph, operator.getitem, (hidden, node.args[1]))
    return hidden


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cast(graph: fx.Graph, node: fx.Node | None, dtype: torch.dtype) -> fx.Node | None:
    if node is None or example_value(node).dtype == dtype:
        return node
    return _call(graph, torch.Tensor.to, (node, dtype))


def chunked_loss_pass(
    gm: fx.GraphModule, report: ChunkedLossReport, *, chunk_tokens: int | None = None
) -> fx.GraphModule:
    """Compute ``cross_entropy(linear(hidden))`` in chunks of tokens, never holding all the logits.

    Before::

        hidden [B, S_r, C] -> linear(W [V, C], b) -> logits [B, S_r, V] -> [:, :-1] / narrow / .float()
            -> view(-1, V) -> [N, V] -> cross_entropy(target [N], reduction="mean" | "sum") -> []

    After::

        hidden [B, S_r, C] -> [:, :-1] / narrow -> reshape(N, C) -> [N, C]
            -> linear_cross_entropy(W, b, target, chunk_tokens, logits_dtype) -> []

    The logits are computed in the LM head's dtype (autocast's, when it is on) and upcast to the
    dtype the cross-entropy ran in. A cross_entropy whose logits are used elsewhere (returned, logged,
    needed after a graph break), or reached through anything but row-wise views and casts, is left
    as it is and listed in ``report.skipped`` with the reason.
    """
    graph = gm.graph
    matches, skipped = find_loss_heads(gm)
    report.skipped.extend(skipped)
    for reason in skipped:
        log.info("AutoSP: loss not chunked: %s", reason)
    for match in matches:
        vocab = example_value(match.weight).shape[0]
        head_dtype = example_value(match.linear).dtype
        logits_dtype = example_value(match.loss).dtype
        with graph.inserting_before(match.loss):
            rows = _rows_of_hidden(graph, match)
            # The op chunks at run time; the token count may be a sequence symbol (one graph for every
            # length), so it is read here for the report only, without guarding on it.
            tokens = symbols.concrete(example_value(rows).shape[0])
            size = chunk_tokens or default_chunk_tokens(vocab)
            args = (
                _cast(graph, rows, head_dtype),
                _cast(graph, match.weight, head_dtype),
                _cast(graph, match.bias, head_dtype),
                match.target,
                match.ignore_index,
                match.reduction,
                size,
                logits_dtype,
            )
            chunked = _call(graph, torch.ops.autosp_loss.linear_cross_entropy.default, args)
        upcast = "" if logits_dtype == head_dtype else f", upcast to {_dtype_name(logits_dtype)}"
        report.chunked.append(
            f"{match.loss.name} ({match.linear.name}: {tokens} tokens x {vocab} vocab in "
            f"{len(token_chunks(tokens, size))} chunk(s) of {min(size, tokens)} at this length; "
            f"logits in {_dtype_name(head_dtype)}{upcast})"
        )
        match.loss.replace_all_uses_with(chunked)
        for node in reversed([match.linear, *match.chain, match.loss]):
            graph.erase_node(node)
        log.info("AutoSP: loss chunked: %s", report.chunked[-1])
    if matches:
        graph.lint()
        gm.recompile()
    return gm
