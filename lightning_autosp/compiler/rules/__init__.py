"""The rule table: op name -> how the op treats the sequence (Note [Proving a graph exact]).

Keys are the names Dynamo's graph calls ops by: a Tensor method (``"view"``), a torch or functional
function (``"scaled_dot_product_attention"``), an ``operator`` function (``"getitem"``). An op that reads
a sequence value and has no entry here is refused, so this table is exactly what the pass can prove.
"""

from __future__ import annotations

from collections.abc import Callable

from lightning_autosp.compiler.rules import dispatch, elementwise, indexing, products, reductions, shapes

Rule = Callable[..., object]


def _table() -> dict[str, Rule]:
    rules: dict[str, Rule] = {}

    def add(names: str | set[str], rule: Rule) -> None:
        for name in names.split() if isinstance(names, str) else names:
            rules[name] = rule

    add(elementwise.POINTWISE, elementwise.pointwise)
    add(elementwise.IN_PLACE, elementwise.in_place)
    add("dropout1d dropout2d dropout3d feature_dropout", elementwise.dropout_over_channels)
    add("view_as_complex view_as_real", elementwise.complex_view)
    add("view reshape flatten unflatten squeeze unsqueeze view_as reshape_as ravel", shapes.view)
    add("permute transpose swapaxes swapdims movedim t T mT", shapes.permute)
    add("expand expand_as broadcast_to repeat", shapes.expand)
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
    add("linear", products.linear)
    add("conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d", products.convolution)
    add("matmul mm bmm", products.matmul)
    add("einsum", products.einsum)
    add("linalg_solve_triangular linalg_solve solve_triangular", products.solve)
    add("addmm baddbmm", products.add_product)
    add("embedding", products.embedding)
    add("one_hot", products.one_hot)
    add(
        "sum nansum count_nonzero mean nanmean amax amin max min any all prod std var norm logsumexp argmax "
        "argmin median mode",
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
