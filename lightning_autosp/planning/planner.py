"""Memory planner: how much each rank holds, by component, before anything is launched.

``plan(model_or_config, seq_len, devices, memory_per_device)`` predicts the per-rank peak memory of a
training step for every choice of ``sp_size``, SAC and data parallelism ("ddp" | "fsdp"), and the
longest sequence each choice can train. ``AutoSPStrategy(sp_size="auto")`` calls
:func:`choose_sp_size` to pick the smallest ``sp_size`` that fits.

Shape letters: B micro-batch (per dp group), S global sequence, P sp ranks, T = B * ceil(S / P)
tokens per rank, L layers, h hidden, H heads, D head dim, h_kv = kv heads * D, I MLP width, V vocab,
N parameters, W = devices (dp x sp ranks).

The per-step memory model, by component, is ``memory_model.py`` (Note [What is saved for backward],
Note [Step peak]); what sequence parallelism sends, ring attention included, is ``sp_cost.py``; the
model's shapes are ``model_shapes.py``. This module chooses among setups and prints plans; its
command line is ``planning/cli.py`` (``python -m lightning_autosp.planning.cli``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from lightning_autosp.compiler.backend import Compiler
from lightning_autosp.fsdp import DataParallel, FSDPGather
from lightning_autosp.planning.memory_model import (
    MemoryBreakdown,
    OptimizerImpl,
    Setup,
    a2a_bytes_per_step,
    ring_bytes_per_step,
    saved_activations,
    step_memory,
)
from lightning_autosp.planning.model_shapes import LLAMA_3_1_8B, LLAMA_3_1_70B, ModelShape, model_shape
from lightning_autosp.planning.sp_cost import UlyssesDegree, sp_layout

__all__ = [
    "LLAMA_3_1_70B",
    "LLAMA_3_1_8B",
    "MemoryBreakdown",
    "ModelShape",
    "Plan",
    "PlanOption",
    "Setup",
    "a2a_bytes_per_step",
    "ring_bytes_per_step",
    "choose_sp_size",
    "model_shape",
    "plan",
    "saved_activations",
    "step_memory",
]

GiB = 2**30


# --------------------------------------------------------------------------------------------------
# plans


@dataclass(frozen=True)
class PlanOption:
    """One setup at the planned sequence length."""

    setup: Setup
    memory: MemoryBreakdown
    usable_bytes: int
    max_seq_len: int
    a2a_bytes_per_step: int
    sp_within_node: bool
    ring_bytes_per_step: int = 0

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.usable_bytes

    def describe(self) -> str:
        """One line: the setup, its peak by component, the longest sequence it fits and what it sends."""
        s, m = self.setup, self.memory
        parts = ", ".join(f"{name} {in_gib(value)}" for name, value in m.items() if name != "total" and value)
        node = "inside a node" if self.sp_within_node else "across nodes"
        ring_bytes = in_gib(self.ring_bytes_per_step)
        ring = f"; ring K/V {ring_bytes} GiB/step/rank" if s.layout.ring_degree > 1 else ""
        return (
            f"sp_size={s.layout.describe()} x dp={s.dp_size} ({s.data_parallel}, sac={s.policy}, "
            f"{s.precision}): peak {in_gib(m.total)} of {in_gib(self.usable_bytes)} GiB usable ({parts}); "
            f"longest sequence {self.max_seq_len} tokens; all-to-alls {in_gib(self.a2a_bytes_per_step)} "
            f"GiB/step/rank{ring}, sp group {node}"
        )


@dataclass(frozen=True)
class Plan:
    """Per-rank memory for each setup, at ``seq_len`` tokens per sequence on ``devices`` GPUs."""

    shape: ModelShape
    seq_len: int
    devices: int
    memory_per_device: int
    usable_bytes: int
    gpus_per_node: int
    options: list[PlanOption]

    def fitting(self) -> list[PlanOption]:
        return [o for o in self.options if o.fits]

    def best(self) -> PlanOption | None:
        """The fitting option with the smallest sp (least communication), then the lowest peak."""
        fitting = self.fitting()
        return min(fitting, key=lambda o: (o.setup.sp_size, o.memory.total)) if fitting else None

    def to_markdown(self) -> str:
        first = self.options[0].setup if self.options else None
        header = (
            f"**{self.shape.name or 'model'}** ({self.shape.param_count / 1e9:.2f}B params), "
            f"{as_tokens(self.seq_len)} tokens x {first.batch_size if first else 1}, {self.devices} devices "
            f"({self.gpus_per_node} per node), {in_gib(self.memory_per_device)} GiB each, "
            f"{in_gib(self.usable_bytes)} GiB usable, {first.precision if first else ''}; GiB per rank"
        )
        names = [f.name for f in fields(MemoryBreakdown) if f.type in (int, "int")]
        sends = ["a2a GiB/step", "ring GiB/step"]
        columns = ["sp", "dp", "SAC", "data par.", *names, "peak", "fits", "max seq", *sends]
        legend = (
            "peak = params + optimizer + comm_buffers + attention_mask + max(activations + "
            "max(logits_workspace, layer_workspace + ring_buffers), grads), or the optimizer step's; "
            "max seq: the longest sequence that fits; sp: ulysses x ring where sp has a ring; "
            "a2a / ring: bytes each rank sends per step"
        )
        lines = [header, "", legend, "", "| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
        for o in self.options:
            cells = [
                o.setup.layout.describe(),
                str(o.setup.dp_size),
                o.setup.policy,
                o.setup.data_parallel,
                *(in_gib(getattr(o.memory, name)) for name in names),
                f"**{in_gib(o.memory.total)}**",
                "yes" if o.fits else "no",
                as_tokens(o.max_seq_len) if o.max_seq_len else "-",
                in_gib(o.a2a_bytes_per_step) + ("" if o.sp_within_node else " (crosses nodes)"),
                in_gib(o.ring_bytes_per_step),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.to_markdown()

    def __rich__(self) -> Any:
        from rich.table import Table

        table = Table(title=f"Per-rank memory, GiB: {self.shape.name}, {as_tokens(self.seq_len)} tokens")
        columns = ["sp", "dp", "SAC", "dp kind", "params", "grads", "optim", "comm", "saved", "mask"]
        for column in [*columns, "workspace", "peak", "fits", "max seq", "a2a GiB/step", "ring GiB/step"]:
            table.add_column(column, justify="right")
        for o in self.options:
            m = o.memory
            table.add_row(
                o.setup.layout.describe(),
                str(o.setup.dp_size),
                o.setup.policy,
                o.setup.data_parallel,
                *(in_gib(v) for v in (m.params, m.grads, m.optimizer, m.comm_buffers, m.activations)),
                in_gib(m.attention_mask),
                in_gib(m.workspace),
                in_gib(m.total),
                "[green]yes[/]" if o.fits else "[red]no[/]",
                as_tokens(o.max_seq_len) if o.max_seq_len else "-",
                in_gib(o.a2a_bytes_per_step) + ("" if o.sp_within_node else " *"),
                in_gib(o.ring_bytes_per_step),
            )
        return table


def in_gib(n: float) -> str:
    """Bytes as GiB for a table cell: one decimal from 10 GiB up, three significant digits below."""
    value = n / GiB
    return f"{value:.1f}" if value >= 10 or value == 0 else f"{value:.3g}"


def as_tokens(n: int) -> str:
    """A token count as a table cell: 128K, 1M."""
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    return f"{n / 1024:.0f}K" if n >= 1024 else str(n)


def max_seq_len(shape: ModelShape, setup: Setup, usable_bytes: int) -> int:
    """The longest sequence (a multiple of sp_size, at most 2**27) whose step fits; 0 if none does."""
    P = setup.sp_size

    def fits(units: int) -> bool:
        return step_memory(shape, setup, units * P).total <= usable_bytes

    lo, hi = 0, 2**27 // P
    if fits(hi):
        return hi * P
    while hi - lo > 1:  # total memory grows with the sequence: bisect
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * P


def valid_sp_sizes(
    shape: ModelShape, devices: int, gpus_per_node: int = 8, ulysses_degree: UlyssesDegree = None
) -> list[int]:
    """sp sizes that divide the devices and that the strategy runs with this ``ulysses_degree``: all
    Ulysses (None) splits the heads, so sp must divide them; with a ring ("auto", an int) sp may exceed
    them (``sp_cost.sp_layout``)."""
    return [
        p
        for p in range(1, devices + 1)
        if devices % p == 0 and sp_layout(p, shape.heads, gpus_per_node, ulysses_degree) is not None
    ]


def _as_tuple(value: Any) -> tuple:
    return tuple(value) if isinstance(value, Iterable) and not isinstance(value, str) else (value,)


def plan(
    model_or_config: Any,
    seq_len: int,
    devices: int,
    memory_per_device: float,
    *,
    sp_sizes: Sequence[int] | None = None,
    sac: bool | str | Sequence[bool] = (True, False),
    data_parallel: DataParallel | Sequence[DataParallel] = ("ddp", "fsdp"),
    precision: str = "bf16-mixed",
    batch_size: int = 1,
    gpus_per_node: int = 8,
    chunked_loss: bool = True,
    loss_chunk_tokens: int | None = None,
    optimizer_states: int = 2,
    fsdp_gather: FSDPGather = "per_use",
    compiler: Compiler = "inductor",
    optimizer_impl: OptimizerImpl = "foreach",
    reserve: float = 0.1,
    ulysses_degree: UlyssesDegree = None,
    offload_activations: bool = False,
    offload_parameters: bool = False,
) -> Plan:
    """Predict per-rank memory for every (sp_size, sac, data_parallel) and the longest trainable sequence.

    Args:
        model_or_config: an ``nn.Module``, an HF config, TinyGPT's config dict or a :class:`ModelShape`.
        seq_len: tokens per sequence (the global length, before sharding).
        devices: GPUs in all (dp x sp).
        memory_per_device: bytes of one GPU (e.g. ``torch.cuda.get_device_properties(0).total_memory``).
        sp_sizes: the sp sizes to consider; default every divisor of ``devices`` the strategy runs with
            ``ulysses_degree`` (without a ring, those that divide the heads).
        sac: True/"auto" (sequence-aware checkpointing; "auto" is planned as True), "longest" (every
            layer rebuilds attention too), False, or several.
        precision: Lightning's precision string ("bf16-mixed": fp32 weights, grads and AdamW state).
        batch_size: sequences per dp group per step.
        gpus_per_node: sp groups larger than this send their all-to-alls over the network.
        chunked_loss / loss_chunk_tokens: as ``AutoSPStrategy``'s options of the same names.
        optimizer_states: tensors per parameter the optimizer keeps (2 for Adam/AdamW, 1 for SGD with
            momentum).
        fsdp_gather: as ``AutoSPStrategy``'s option: "per_use" gathers each parameter where the step
            uses it; "per_step" gathers the whole model for the step.
        compiler: as ``AutoSPStrategy``'s option ("aot_eager" holds saved tensors until backward ends).
        optimizer_impl: "foreach" (PyTorch's default on GPU), "for_loop" (on CPU) or "fused": what the
            optimizer step allocates besides the state (Note [Step peak]).
        reserve: share of ``memory_per_device`` left for the CUDA context, NCCL and fragmentation.
        ulysses_degree: as ``AutoSPStrategy``'s option: None (all of sp is Ulysses), "auto" or an int
            (the rest of sp is ring attention, priced by ``sp_cost.py``: Note [Ring attention costs]).
        offload_activations: as ``AutoSPStrategy``'s option: saved values wait in host memory.
        offload_parameters: as ``AutoSPStrategy``'s option (data_parallel="fsdp", fsdp_gather="per_step").
    """
    shape = model_shape(model_or_config)
    if seq_len < 1 or devices < 1:
        raise ValueError(f"seq_len={seq_len} and devices={devices} must be positive.")
    valid = valid_sp_sizes(shape, devices, gpus_per_node, ulysses_degree)
    sizes = list(sp_sizes) if sp_sizes is not None else [p for p in valid if p <= seq_len]
    bad = [p for p in sizes if p not in valid or p > seq_len]
    if bad:
        ring_hint = "" if ulysses_degree is not None else " (ulysses_degree='auto' adds ring attention)"
        raise ValueError(
            f"sp_size {bad} must divide devices={devices}, be possible with heads={shape.heads} and "
            f"ulysses_degree={ulysses_degree!r}{ring_hint}, and not exceed seq_len={seq_len}; use one of "
            f"{[p for p in valid if p <= seq_len]}."
        )
    usable = int(memory_per_device * (1 - reserve))
    options = []
    for p in sizes:
        for recompute in _as_tuple(sac):
            for kind in _as_tuple(data_parallel):
                setup = Setup(
                    sp_size=p,
                    devices=devices,
                    sac=recompute in (True, "auto", "longest"),
                    rebuild_attention=recompute == "longest",
                    offload_activations=offload_activations,
                    offload_parameters=offload_parameters and kind == "fsdp",
                    data_parallel=kind,
                    precision=precision,
                    batch_size=batch_size,
                    chunked_loss=chunked_loss,
                    loss_chunk_tokens=loss_chunk_tokens,
                    optimizer_states=optimizer_states,
                    fsdp_gather=fsdp_gather,
                    compiler=compiler,
                    optimizer_impl=optimizer_impl,
                    ulysses_degree=sp_layout(p, shape.heads, gpus_per_node, ulysses_degree).ulysses_degree,
                )
                options.append(
                    PlanOption(
                        setup=setup,
                        memory=step_memory(shape, setup, seq_len),
                        usable_bytes=usable,
                        max_seq_len=max_seq_len(shape, setup, usable),
                        a2a_bytes_per_step=a2a_bytes_per_step(shape, setup, seq_len),
                        sp_within_node=p <= gpus_per_node,
                        ring_bytes_per_step=ring_bytes_per_step(shape, setup, seq_len),
                    )
                )
    return Plan(shape, seq_len, devices, int(memory_per_device), usable, gpus_per_node, options)


def choose_sp_size(
    model_or_config: Any,
    *,
    seq_len: int,
    devices: int,
    memory_per_device: float,
    gpus_per_node: int,
    sac: bool | str = True,
    data_parallel: DataParallel = "ddp",
    precision: str = "bf16-mixed",
    batch_size: int = 1,
    chunked_loss: bool = True,
    loss_chunk_tokens: int | None = None,
    fsdp_gather: FSDPGather = "per_use",
    compiler: Compiler = "inductor",
    ulysses_degree: UlyssesDegree = None,
    offload_activations: bool = False,
    offload_parameters: bool = False,
) -> PlanOption:
    """The plan of the smallest sp_size whose step fits in ``memory_per_device``.

    Raises:
        ValueError: nothing fits; the message lists the longest sequence each sp_size can train.
    """
    result = plan(
        model_or_config,
        seq_len,
        devices,
        memory_per_device,
        sac=sac,
        data_parallel=data_parallel,
        precision=precision,
        batch_size=batch_size,
        gpus_per_node=gpus_per_node,
        chunked_loss=chunked_loss,
        loss_chunk_tokens=loss_chunk_tokens,
        fsdp_gather=fsdp_gather,
        compiler=compiler,
        ulysses_degree=ulysses_degree,
        offload_activations=offload_activations,
        offload_parameters=offload_parameters,
    )
    best = result.best()
    if best is not None:
        return best
    longest = ", ".join(f"sp={o.setup.sp_size}: {o.max_seq_len}" for o in result.options)
    smallest = min(result.options, key=lambda o: o.memory.total)
    hints = []
    if data_parallel == "ddp":
        hints.append("data_parallel='fsdp'")
    if sac != "longest":
        hints.append("sac='longest' (every layer rebuilds attention in backward)")
    if not chunked_loss:
        hints.append("chunked_loss=True")
    if ulysses_degree is None and devices > result.shape.heads:
        hints.append(f"ulysses_degree='auto' (ring attention takes sp beyond the {result.shape.heads} heads)")
    hints.append("more devices or a shorter max_seq_len")
    raise ValueError(
        f"No sp_size fits a {seq_len}-token step of {result.shape.name or 'the model'} on {devices} devices "
        f"with {in_gib(result.usable_bytes)} GiB usable each (sac={sac}, data_parallel={data_parallel!r}, "
        f"precision={precision!r}): the smallest needs {in_gib(smallest.memory.total)} GiB at "
        f"sp={smallest.setup.sp_size}. Longest sequence per sp_size: {longest}. Try {', '.join(hints)}."
    )


def check_auto_sp_options(sp_size: object, max_seq_len: object, memory_per_device: object) -> bool:
    """Whether ``sp_size="auto"`` was asked for; raise on options that only make sense with it."""
    auto = sp_size == "auto"
    if auto and (not isinstance(max_seq_len, int) or isinstance(max_seq_len, bool) or max_seq_len < 1):
        raise ValueError(
            "sp_size='auto' needs the sequence length to plan for: max_seq_len=<tokens>, got "
            f"{max_seq_len!r}."
        )
    if not auto and (max_seq_len is not None or memory_per_device is not None):
        raise ValueError(
            "max_seq_len and memory_per_device are used to choose sp_size; pass sp_size='auto' with them."
        )
    positive = isinstance(memory_per_device, (int, float)) and memory_per_device > 0
    if memory_per_device is not None and not positive:
        raise ValueError(f"memory_per_device must be a positive number of bytes, got {memory_per_device!r}.")
    return auto


# Note [Planning sp_size after configure_model]
#     Lightning sets a strategy up in this order: setup_environment (which calls setup_distributed
#     and creates the process group), the `setup` hooks, configure_model, then Strategy.setup. A
#     module built in configure_model (on the meta device or not) does not exist in
#     setup_distributed, so sp_size="auto" is planned at the start of setup(), from the module's
#     parameter shapes, meta or real (the planner reads shapes only). The process group is created
#     as usual, since creating it needs no sp_size; the ("dp", "sp") mesh, which does, is built
#     right after planning, before anything uses it (the sampler, the compiled steps and the FSDP
#     mesh all come after setup() starts). Every rank plans from the same module and options, so
#     all choose alike, or all raise the planner's error before any collective.


def auto_sp_size(
    module: nn.Module,
    *,
    max_seq_len: int,
    memory_per_device: float | None,
    device: torch.device,
    devices: int,
    gpus_per_node: int,
    sac: bool | str,
    data_parallel: DataParallel,
    precision: str,
    chunked_loss: bool,
    loss_chunk_tokens: int | None,
    fsdp_gather: FSDPGather = "per_use",
    compiler: Compiler = "inductor",
    ulysses_degree: UlyssesDegree = None,
    offload_activations: bool = False,
    offload_parameters: bool = False,
) -> PlanOption:
    """``AutoSPStrategy(sp_size="auto")``: the smallest sp_size that fits ``max_seq_len`` tokens.

    Every rank computes the same plan from the same inputs, so all of them choose alike (or all raise)
    without a collective. ``memory_per_device`` defaults to the CUDA device's total memory.
    """
    if memory_per_device is None:
        if device.type != "cuda":
            raise ValueError(
                f"sp_size='auto' on a {device.type} device needs memory_per_device=<bytes per device>."
            )
        memory_per_device = torch.cuda.get_device_properties(device).total_memory
    try:
        shape = model_shape(module)
    except TypeError as error:
        raise TypeError(f"sp_size='auto' cannot plan: {error} Or pass sp_size=<int>.") from None
    chosen = choose_sp_size(
        shape,
        seq_len=max_seq_len,
        devices=devices,
        memory_per_device=memory_per_device,
        gpus_per_node=gpus_per_node,
        sac=sac,
        data_parallel=data_parallel,
        precision=precision,
        chunked_loss=chunked_loss,
        loss_chunk_tokens=loss_chunk_tokens,
        fsdp_gather=fsdp_gather,
        compiler=compiler,
        ulysses_degree=ulysses_degree,
        offload_activations=offload_activations,
        offload_parameters=offload_parameters,
    )
    rank_zero_info(f"sp_size='auto' for {max_seq_len} tokens: {chosen.describe()}")
    return chosen


if __name__ == "__main__":  # the command line's older name
    raise SystemExit("The planner's command line is: python -m lightning_autosp.planning.cli --help")
