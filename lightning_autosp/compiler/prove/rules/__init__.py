"""The rule table: op -> how the op treats the sequence (Note [Proving a graph exact]).

Entries are written as the names users spell ops by: a Tensor method (``"view"``), a torch or functional
function (``"scaled_dot_product_attention"``), an ``operator`` function (``"getitem"``). The table the
analysis reads is keyed by the op itself: each name is resolved to the callables it stands for in the
namespaces Dynamo records calls from, so another spelling of the same function (``F.logsigmoid`` is
``torch._C._nn.log_sigmoid``) finds its rule. Methods are keyed by name (a method is its name), and so are
ops recorded as ``torch.ops`` packets or higher-order ops. An op no entry covers is pointwise if torch
decomposes it into pointwise ops (Note [Rules derived from torch] in ``rules/derived.py``) and refused
otherwise, so the table and that derivation are exactly what the pass can prove.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
from torch import fx

from lightning_autosp.compiler.fx_utils import op_name
from lightning_autosp.compiler.prove.plan import Decided
from lightning_autosp.compiler.prove.rules import (
    derived,
    dispatch,
    elementwise,
    indexing,
    products,
    reductions,
    shapes,
    views,
)

Rule = Callable[..., Decided]  # (analysis, node) -> the op's layout, or a Decision


def _table() -> dict[str, Rule]:
    rules: dict[str, Rule] = {}

    def add(names: str | set[str], rule: Rule) -> None:
        for name in names.split() if isinstance(names, str) else names:
            rules[name] = rule

    add(elementwise.POINTWISE, elementwise.pointwise)
    add(elementwise.IN_PLACE, elementwise.in_place)
    add("dropout1d dropout2d dropout3d feature_dropout", elementwise.dropout_over_channels)
    add("view_as_complex view_as_real", elementwise.complex_view)
    add("view reshape flatten unflatten squeeze unsqueeze view_as reshape_as ravel", views.view)
    add("permute transpose swapaxes swapdims movedim t T mT", shapes.permute)
    add("expand expand_as broadcast_to repeat tile", shapes.expand)
    add("getitem", indexing.getitem)
    add("setitem", indexing.setitem)
    add("narrow slice", indexing.narrow)
    add("select", indexing.select)
    add(
        "index_select gather take_along_dim scatter scatter_add scatter_reduce index_add index_copy "
        "index_fill index_put scatter_ scatter_add_ scatter_reduce_ index_add_ index_copy_ index_fill_ "
        "index_put_",
        indexing.index_along,
    )
    add("pad", shapes.pad)
    add("_add_batch_dim _remove_batch_dim", shapes.vmap_batch_dim)
    add("_vmap_increment_nesting", shapes.vmap_level)
    add("cat concat concatenate", shapes.cat)
    add("stack", shapes.stack)
    add("split chunk tensor_split split_with_sizes unbind", shapes.pieces)
    add("zeros ones full empty rand randn randint new_zeros new_ones new_full new_empty", shapes.factory)
    add("zeros_like ones_like full_like empty_like rand_like randn_like", shapes.like)
    add("arange", shapes.arange)
    add("tensor scalar_tensor as_tensor sym_float sym_int", shapes.value_of_sizes)
    add("softmax log_softmax _softmax softmin", reductions.softmax)
    add("normalize", reductions.normalize)
    add("cumsum cumprod cummax cummin logcumsumexp", reductions.scan)
    add("sort argsort topk kthvalue msort", reductions.sort)
    add("flip fliplr flipud", reductions.flip)
    add("roll", reductions.roll)
    add("diff", reductions.diff)
    add("tril triu", reductions.triangle)
    add("repeat_interleave", reductions.repeat_interleave)
    add("layer_norm rms_norm", reductions.norm_over_last)
    add("batch_norm instance_norm group_norm", reductions.norm_over_channels)
    add("outer ger", elementwise.outer)
    add("linear", products.linear)
    add("conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d", products.convolution)
    add("matmul mm bmm", products.matmul)
    add("einsum", products.einsum)
    add("linalg_solve_triangular linalg_solve solve_triangular", products.solve)
    add("addmm baddbmm", products.add_product)
    add("embedding", products.embedding)
    add("one_hot", products.one_hot)
    add(
        "sum nansum count_nonzero mean nanmean amax amin max min any all prod std var norm "
        "linalg_vector_norm vector_norm logsumexp argmax argmin median mode",
        reductions.reduction,
    )
    add("histc bincount", reductions.histogram)
    add("grouped_mm _grouped_mm grouped_mm_fallback", dispatch.grouped_mm)
    add("cross_entropy nll_loss", reductions.class_loss)
    add(
        "mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits "
        "kl_div",
        reductions.elementwise_loss,
    )
    add("scaled_dot_product_attention", products.sdpa)
    add("autograd_function_apply _flash_attn_forward _flash_attn_varlen_forward", products.flash)
    add("cond invoke_subgraph while_loop map_impl", products.refuse_subgraph)
    add("multi_head_attention_forward", products.refuse_attention_weights)
    return rules


RULES = _table()

# Where the functions Dynamo records live; ``operator`` only for the arithmetic and item access it spells.
_NAMESPACES = (
    torch,
    torch.nn.functional,
    torch._C._nn,
    torch._C._VariableFunctions,
    torch.special,
    torch._C._special,
    torch.linalg,
    torch._C._linalg,
    torch.fft,
    torch._C._fft,
)
_OPERATOR_RULES = (elementwise.pointwise, elementwise.in_place, indexing.getitem, indexing.setitem)


def _by_callable(named: dict[str, Rule]) -> dict[Callable, Rule]:
    """Each entry's name resolved to the functions it names. A function whose own name has an entry keeps
    that entry's rule (``torch.nn.functional.pad`` and ``torch._C._nn.pad`` alike)."""
    table: dict[Callable, Rule] = {}
    for name, rule in named.items():
        namespaces = (*_NAMESPACES, operator) if rule in _OPERATOR_RULES else _NAMESPACES
        for namespace in namespaces:
            function = getattr(namespace, name, None)
            if callable(function) and not isinstance(function, type) and _hashable(function):
                table.setdefault(function, named.get(getattr(function, "__name__", ""), rule))
    return table


def _hashable(value: object) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


RULES_BY_OP = _by_callable(RULES)


def rule_for(node: fx.Node) -> Rule | None:
    """The rule of what ``node`` calls: by the function itself, by name for methods, ``torch.ops`` packets
    and higher-order ops, else the pointwise rule where torch decomposes the call into pointwise ops."""
    if node.op == "call_function" and _hashable(node.target) and node.target in RULES_BY_OP:
        return RULES_BY_OP[node.target]
    rule = RULES.get(op_name(node))
    if rule is not None:
        return rule
    return elementwise.pointwise if derived.acts_on_each_element(node) else None
