"""The sequence-parallel (SP) pass over a Dynamo graph: prove, then rewrite.

Each rank's graph is traced on its own sequence shard [B, S_r, ...] with S_r as a symbol (Note
[Symbolic sequence lengths] in ``symbols.py``). The analysis (``analysis.py``, Note [Proving a graph
exact]) gives every value a sequence layout and lists the rewrites that make each rank compute exactly
its part of the single-device result, or refuses the graph before anything runs. Then, in order:

1. masks and token data are computed for the whole sequence where an op needs them so (``masks.py``,
   ``recompute.py``), from the graph as traced;
2. attention sees the whole sequence for a slice of the heads (``attention.py``);
3. positions and position tables count from this rank's first token (``positions.py``);
4. slices, shifts and pads along the sequence are taken of the global sequence (``slices.py``);
5. sequence lengths become numbers: global where used as values, this rank's counts as shapes;
6. reductions over the sequence become global (``losses.py``).

Before 1, every value an op needs in another layout moves there (``redistribute.py``, Note
[Redistribution] in ``analysis.py``): all-to-alls to and from split values, all-reduces of partial sums.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import fx
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from lightning_autosp.compiler import attention, masks, symbols
from lightning_autosp.compiler.analysis import Analysis
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.fx_utils import eliminate_dead_code, meta_value
from lightning_autosp.compiler.layout import SequenceTags, Tag
from lightning_autosp.compiler.losses import losses_pass
from lightning_autosp.compiler.normalize import normalize_pass
from lightning_autosp.compiler.positions import lengths_pass, positions_pass
from lightning_autosp.compiler.recompute import GlobalCopier, recompute_pass
from lightning_autosp.compiler.redistribute import redistribute_pass
from lightning_autosp.compiler.slices import selections_pass, slices_pass

log = logging.getLogger(__name__)


@dataclass
class SPReport:
    """What the SP pass did to one graph, for ``AutoSPStrategy.explain()`` and tests."""

    attention: list[str] = field(default_factory=list)
    all_to_alls: int = 0
    ring_attention: list[str] = field(default_factory=list)
    replicated_kv_heads: list[str] = field(default_factory=list)
    casts: list[str] = field(default_factory=list)
    masks: list[str] = field(default_factory=list)
    positions: list[str] = field(default_factory=list)
    slices: list[str] = field(default_factory=list)
    recomputed: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    redistributions: list[str] = field(default_factory=list)
    normalized: list[str] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    output_tags: list[Tag | None] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [*self.normalized]
        out.append(f"attention nodes: {len(self.attention)} ({', '.join(self.attention) or 'none'})")
        out.append(f"all-to-alls inserted: {self.all_to_alls}")
        for title, items in (
            ("ring attention (K/V passed around the ring group)", self.ring_attention),
            ("KV heads replicated", self.replicated_kv_heads),
            ("cast to attention's dtype before the all-to-all", self.casts),
            ("masks", self.masks),
            ("positions made global", self.positions),
            ("sequence slices/pads made global", self.slices),
            ("token data computed for the whole sequence", self.recomputed),
            ("reductions and losses made global", self.losses),
            ("layouts", self.layouts),
        ):
            if items:
                out.append(f"{title}: {', '.join(items)}")
        if self.redistributions:  # one a line: each names its op and the user's source line
            out.append("redistributed (value, from -> to, for which op, collective, bytes on this rank):")
            out.extend(f"  {line}" for line in self.redistributions)
        return out


def sequence_parallel_pass(
    gm: fx.GraphModule,
    example_inputs: Sequence[object],
    ctx: SPContext,
    tags: SequenceTags,
    *,
    check_guards: bool = True,
) -> tuple[fx.GraphModule, SPReport]:
    """Prove one (sub-)graph exact under sequence sharding and rewrite it (module docstring).

    Raises:
        NotImplementedError: an op the pass cannot prove exact (all of them, with source lines and fixes).
        ValueError: the heads do not divide by the sp (Ulysses) degree.
    """
    report = SPReport()
    shape_env = symbols.graph_shape_env(gm, example_inputs)
    traced_guards = symbols.guard_count(shape_env)  # the pass must add none; it checks Dynamo's
    report.normalized = normalize_pass(gm).lines()
    analysis = Analysis(gm, example_inputs, ctx, tags).run()
    if check_guards:
        analysis.check_guards(shape_env, traced_guards)
    analysis.raise_refusals()
    for node in analysis.plan.attention:
        if node in analysis.flash_matches:
            attention.check_flash_heads(analysis.flash_matches[node], ctx)
        else:
            attention.check_sdpa(node, ctx)
    _specialize(gm, analysis)
    report.output_tags = list(analysis.output_tags)

    copier = GlobalCopier(gm, analysis, ctx)
    for node in analysis.plan.attention:  # whole masks first, from the graph as traced
        if node not in analysis.flash_matches:
            args = attention.bind(node, attention.SDPA_SIGNATURE)
            mask = masks.attention_mask(
                copier,
                node,
                args["attn_mask"],
                attention.sdpa_heads(node),
                bool(args["is_causal"]),
                report.masks,
            )
            attention.set_mask(node, *mask)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    masks.hand_on_masks(copier, output, report.output_tags, report.masks)
    for value, tag in zip(analysis.output_nodes, report.output_tags):  # for DDP's next bucket (analysis.py)
        if tag is not None and isinstance(meta_value(value), torch.Tensor):
            tags.mark(meta_value(value), tag)
    eliminate_dead_code(gm.graph)  # the per-rank masks replaced by whole ones (and what only they used)
    report.layouts = _explained_layouts(analysis, gm.graph)
    report.redistributions = redistribute_pass(gm, copier, ctx)
    report.all_to_alls += sum(move.via == "all_to_all" for move in analysis.plan.redistributions)
    report.recomputed = recompute_pass(copier)
    eliminate_dead_code(gm.graph)

    for node in analysis.plan.attention:
        if node in analysis.flash_matches:
            attention.flash_pass(gm, analysis.flash_matches[node], ctx, report)
        else:
            attention.sdpa_pass(gm.graph, node, ctx, report)
    positions_pass(gm, analysis, ctx, report.positions)
    slices_pass(gm, analysis, ctx, copier.pristine, report.slices)
    selections_pass(gm, analysis, ctx, copier.pristine, report.slices)
    lengths_pass(gm, analysis, ctx)
    losses_pass(gm, analysis, ctx, copier.pristine, report.losses)
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    _refresh_fake_values(gm, example_inputs)
    return gm, report


def _specialize(gm: fx.GraphModule, analysis: Analysis) -> None:
    """Fix every sequence symbol to this rank's length (Note [Symbolic sequence lengths])."""
    for node, tag in analysis.input_tags.items():
        value = meta_value(node)
        if not isinstance(value, torch.Tensor) or not tag.layout.is_shard:
            continue
        for dim in tag.layout.dims:
            size = value.shape[dim]
            if isinstance(size, torch.SymInt) and symbols.raw_expr(size) in analysis.lengths:
                symbols.specialize(size)


def _refresh_fake_values(gm: fx.GraphModule, example_inputs: Sequence[object]) -> None:
    """Recompute every node's fake value at this rank's shapes (later passes read them)."""
    mode = next((v.fake_mode for v in example_inputs if getattr(v, "fake_mode", None) is not None), None)
    if mode is None:
        mode = getattr(torch._guards.TracingContext.try_get(), "fake_mode", None)
    if mode is None:
        return
    try:
        # Identity hooks: a user's saved-tensor hooks (MemoryMonitor's) must not run inside the compiler.
        with torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x):
            FakeTensorProp(gm, mode).propagate(*example_inputs)
    except Exception as error:  # shapes are a convenience for later passes, not a requirement
        log.debug("fake values not refreshed: %s", error)
        return
    for node in gm.graph.nodes:
        if "val" in node.meta:
            node.meta["example_value"] = node.meta["val"]


def _explained_layouts(analysis: Analysis, graph: fx.Graph) -> list[str]:
    """The layouts a user cares about: positions, token data computed whole, losses and partial sums
    (those still used once the masks are whole)."""
    plan = analysis.plan
    notable = [*plan.positions, *plan.tables, *plan.recompute, *plan.losses]
    alive = set(graph.nodes)
    return [f"{node.name}={analysis.layouts.get(node)}" for node in dict.fromkeys(notable) if node in alive]
