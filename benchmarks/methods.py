"""The ways of training one model on one global batch over the same ranks, one class each.

Every rank holds the same global batch ``ids`` [B, S]. ``Method.prepare(ids)`` returns a ``Prepared``
step for that sequence length: ``forward()`` -> loss (with its autograd graph), ``backward(loss)`` (backward
and gradient synchronisation), ``reported_loss(loss)`` (what this rank would log). After ``backward``
every rank's ``method.model`` holds the single-device gradients of the whole batch, up to the method's
own error; ``method.model``'s parameter names are those of the single-device model, so gradients compare
by name.

Gradient synchronisation is one ``all_reduce`` per gradient after backward, the same for every method
but DeepSpeed's, whose ``engine.backward`` does its own. No method builds an optimizer.

=============  ========================================================================================
``sac``        this project: ``AutoSPBackend(sac=True)`` (SP pass + sequence-aware checkpointing), each
               rank gets its shard from ``shard_batch``; the single-device step compiled unchanged
``sp``         the same without SAC (PyTorch's min-cut partitioner)
``longest``    the same with ``sac="longest"``: every layer keeps only its input and rebuilds attention and
               its all-to-alls in backward too (ALST's trade, chosen by the compiler)
``longest_offload`` ``longest`` with ``offload_activations=True``: the layer inputs wait in host memory
               (a GPU's memory; on CPU the copies stay in host memory and free nothing)
``deepspeed``  DeepSpeed's AutoSP as its docs and examples drive it: ``deepspeed.initialize`` with
               ``{"compile": {"deepcompile": true, "passes": ["autosp"]}, "sequence_parallel_size": P}``,
               ``engine.compile()``, and every step ``prepare_autosp_inputs(input_ids, labels,
               position_ids, attention_mask)`` on the *full* sequence, ``engine(...)``,
               ``engine.backward(loss)``; its SAC (``register_long_context_checkpointing``) is confined
               to its own compiles. The all-ones ``attention_mask`` is what DeepSpeed's example passes;
               without it the pass fails on HF's mask ("expand: attempting to expand a dimension of
               length s27 -> (s27//2)!")
``ulysses``    hand-written Ulysses: DeepSpeed's ``DistributedAttention`` in every attention layer, the
               loss over this rank's slice with targets shifted before sharding, compiled with plain
               ``torch.compile`` (Inductor)
``ddp``        no sequence parallelism: every rank runs the whole sequence (plain ``torch.compile``); HF
               Llama with a mask-free causal SDPA (``models.py``: HF's own path would carry an [S, S]
               mask under ``torch.compile``)
``ring``       PyTorch's ``context_parallel`` (ring attention, head-tail load balancing) around the same
               hand-written loss, compiled with plain ``torch.compile``
``alst``       the record holders' recipe (``benchmarks/alst.py``): hand-written Ulysses with every layer
               checkpointed, DeepSpeed's ``TiledMLP`` and ``TiledFusedLogitsLoss``, eager as ArcticTraining
               runs it
=============  ========================================================================================
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.common import current_solve_min_cut, set_solve_min_cut, solve_min_cut_as
from benchmarks.models import (
    GPTWithLoss,
    ModelSpec,
    build,
    full_sequence_loss,
    sharded_loss,
    shifted_targets,
)
from lightning_autosp.extras import require


@dataclass(frozen=True)
class RunContext:
    """Where the methods run: this rank, the group of all ranks, the device, compiler and dtype."""

    rank: int
    world: int
    group: Any
    device: torch.device
    compiler: str = "inductor"  # "inductor" or "aot_eager" (smoke runs); DeepSpeed always uses Inductor
    dtype: torch.dtype = torch.float32
    autocast: torch.dtype | None = None  # bf16-mixed: fp32 parameters, every forward under autocast


@dataclass
class Prepared:
    forward: Callable[[], Tensor]
    backward: Callable[[Tensor], None]
    reported_loss: Callable[[Tensor], float]

    def step(self) -> Tensor:
        loss = self.forward()
        self.backward(loss)
        return loss

    def under_autocast(self, device: torch.device, dtype: torch.dtype | None) -> Prepared:
        """This step with its forward under ``torch.autocast(dtype)`` (mixed precision); as is for None."""
        if dtype is None:
            return self
        forward = self.forward

        def autocast_forward() -> Tensor:
            with torch.autocast(device.type, dtype=dtype):
                return forward()

        return Prepared(autocast_forward, self.backward, self.reported_loss)


def sync_grads(model: nn.Module, group: Any, world: int, op: str) -> None:
    """All-reduce every gradient: ``"avg"`` (replicated losses) or ``"sum"`` (per-rank shares of one loss)."""
    if world == 1:
        return
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, group=group)
            if op == "avg":
                param.grad /= world


def _all_reduced(value: Tensor, group: Any) -> float:
    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item()


def _positions(ids: Tensor) -> Tensor:
    return torch.arange(ids.shape[1], device=ids.device).expand_as(ids).contiguous()


def _require_divisible(seq_len: int, divisor: int, method: str) -> None:
    if seq_len % divisor:
        raise ValueError(f"{method}: sequence length {seq_len} must be a multiple of {divisor}.")


class Method:
    name: ClassVar[str]
    label: ClassVar[str]

    def __init__(self, spec: ModelSpec, ctx: RunContext) -> None:
        self.spec, self.ctx = spec, ctx
        self.info: dict = {}

    @property
    def model(self) -> nn.Module:
        return self._model

    def _build(self, attention: str = "sdpa", group: Any = None) -> nn.Module:
        self._model = build(self.spec, attention, group).to(self.ctx.device, self.ctx.dtype)
        return self._model

    def prepare(self, ids: Tensor) -> Prepared:
        raise NotImplementedError


class Ours(Method):
    """This project's compiler backend on the single-device step (``sac`` or ``sp``)."""

    sac: ClassVar[bool | str]
    offload_activations: ClassVar[bool] = False

    def __init__(self, spec: ModelSpec, ctx: RunContext) -> None:
        super().__init__(spec, ctx)
        self.loss = full_sequence_loss(spec, self._build())
        self.backends: list = []

    def prepare(self, ids: Tensor) -> Prepared:
        from lightning_autosp.compiler.backend import AutoSPBackend
        from lightning_autosp.compiler.sp_pass import SPContext
        from lightning_autosp.data import shard_batch

        ctx = self.ctx
        batch, context = {"input_ids": ids}, None
        if ctx.world > 1:
            batch, shard = shard_batch(batch, world=ctx.world, rank=ctx.rank)
            context = SPContext(shard, ctx.group.group_name)
        backend = AutoSPBackend(
            context, compiler=ctx.compiler, sac=self.sac, offload_activations=self.offload_activations
        )
        if context is not None:
            backend.mark_sharded(batch["input_ids"])
        self.backends.append(backend)
        fn = torch.compile(self.loss, backend=backend, dynamic=False)

        def backward(loss: Tensor) -> None:
            loss.backward()
            sync_grads(self.model, ctx.group, ctx.world, "avg")

        return Prepared(lambda: fn(batch), backward, lambda loss: loss.item())

    def graph_facts(self) -> dict:
        if not self.backends:  # never prepared (the run's deadline came first): nothing to report
            return {}
        backend = self.backends[-1]
        return {
            "graphs": len(backend.reports),
            "attention": backend.attention_count,
            "all_to_alls_inserted": sum(report.all_to_alls for report in backend.reports),
        }


class OursSAC(Ours):
    name, label, sac = "sac", "ours: SP + SAC", True


class OursSP(Ours):
    name, label, sac = "sp", "ours: SP", False


class OursLongest(Ours):
    name, label, sac = "longest", "ours: SP + SAC, longest", "longest"


class OursLongestOffload(Ours):
    name, label, sac = "longest_offload", "ours: longest, inputs offloaded", "longest"
    offload_activations = True


class DeepSpeedAutoSP(Method):
    name, label = "deepspeed", "DeepSpeed AutoSP"

    def __init__(self, spec: ModelSpec, ctx: RunContext) -> None:
        super().__init__(spec, ctx)
        require("deepspeed", extra="bench", needed_by="DeepSpeed's AutoSP (benchmarks.methods)")
        import deepspeed

        model = self._build()
        module = model if spec.family == "llama" else GPTWithLoss(model)
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {"stage": 0},
            "compile": {"deepcompile": True, "passes": ["autosp"]},
            "sequence_parallel_size": ctx.world,
            "bf16": {"enabled": ctx.dtype == torch.bfloat16},
        }
        # engine.backward refuses to run without an optimizer; SGD at lr=0 keeps no state.
        optimizer = torch.optim.SGD(module.parameters(), lr=0.0)
        self.engine, *_ = deepspeed.initialize(model=module, optimizer=optimizer, config=config)
        # engine.compile() builds the AutoSP backend, which splices DeepSpeed's SAC into torch's
        # partitioner for the whole process; keep it for this engine's compiles only.
        original = current_solve_min_cut()
        self.engine.compile()
        self.solver = current_solve_min_cut()
        set_solve_min_cut(original)
        self.info["deepspeed_sac_spliced"] = self.solver is not original
        self.info["deepspeed"] = deepspeed.__version__

    def prepare(self, ids: Tensor) -> Prepared:
        from deepspeed.compile.passes.sp_compile import prepare_autosp_inputs

        _require_divisible(ids.shape[1], self.ctx.world, self.name)  # its shard is S // P, rank baked in
        positions, mask = _positions(ids), torch.ones_like(ids)
        engine, llama = self.engine, self.spec.family == "llama"

        def forward() -> Tensor:
            # Fresh tensors every step: prepare_autosp_inputs tags them and marks the sequence dynamic.
            if llama:
                input_ids, labels, position_ids, attention_mask = prepare_autosp_inputs(
                    ids.clone(), ids.clone(), positions.clone(), mask.clone(), seq_dim=1
                )
                with solve_min_cut_as(self.solver):
                    return engine(
                        input_ids=input_ids,
                        labels=labels,
                        position_ids=position_ids,
                        attention_mask=attention_mask,
                    ).loss
            input_ids, labels, _, _ = prepare_autosp_inputs(ids.clone(), ids.clone(), seq_dim=1)
            with solve_min_cut_as(self.solver):
                return engine(input_ids=input_ids, labels=labels)

        return Prepared(forward, engine.backward, lambda loss: loss.item())


class Ulysses(Method):
    name, label = "ulysses", "hand-written Ulysses"

    def __init__(self, spec: ModelSpec, ctx: RunContext) -> None:
        super().__init__(spec, ctx)
        require("deepspeed", extra="bench", needed_by=f"{self.label} (benchmarks.methods)")
        import deepspeed

        deepspeed.init_distributed(dist_backend=dist.get_backend(ctx.group), verbose=False)
        self.fn = self._sharded_step()

    def _sharded_step(self) -> Callable[[Tensor, Tensor, Tensor, int], Tensor]:
        """The model (DeepSpeed's ``DistributedAttention`` in every layer) and its step over this rank's
        slice, compiled with plain ``torch.compile``."""
        model = self._build("ulysses", self.ctx.group)
        return torch.compile(sharded_loss(self.spec, model), backend=self.ctx.compiler, dynamic=False)

    def prepare(self, ids: Tensor) -> Prepared:
        ctx = self.ctx
        _require_divisible(ids.shape[1], ctx.world, self.name)
        local = slice(ctx.rank * ids.shape[1] // ctx.world, (ctx.rank + 1) * ids.shape[1] // ctx.world)
        inputs = (ids[:, local], _positions(ids)[:, local], shifted_targets(ids)[:, local])
        n_targets = ids.shape[0] * (ids.shape[1] - 1)

        def backward(loss: Tensor) -> None:
            loss.backward()
            sync_grads(self.model, ctx.group, ctx.world, "sum")

        return Prepared(
            lambda: self.fn(*inputs, n_targets), backward, lambda loss: _all_reduced(loss, ctx.group)
        )


class ALST(Ulysses):
    name, label = "alst", "ALST-style (Ulysses, layers checkpointed, tiled MLP and loss)"

    def _sharded_step(self) -> Callable[[Tensor, Tensor, Tensor, int], Tensor]:
        """Ulysses' model with ALST's levers, and its step with the tiled loss; eager, as ArcticTraining runs
        it (``TiledFusedLogitsLoss`` runs backward inside forward)."""
        from benchmarks.alst import alst_loss, alst_model

        self._model = alst_model(self.spec, self.ctx.group).to(self.ctx.device, self.ctx.dtype)
        return alst_loss(self.spec, self._model)


class DDP(Method):
    name, label = "ddp", "DDP (full sequence)"

    def __init__(self, spec: ModelSpec, ctx: RunContext) -> None:
        super().__init__(spec, ctx)
        model = self._build("causal")
        self.fn = torch.compile(full_sequence_loss(spec, model), backend=ctx.compiler, dynamic=False)

    def prepare(self, ids: Tensor) -> Prepared:
        ctx = self.ctx

        def backward(loss: Tensor) -> None:
            loss.backward()
            sync_grads(self.model, ctx.group, ctx.world, "avg")

        return Prepared(lambda: self.fn({"input_ids": ids}), backward, lambda loss: loss.item())


class Ring(Method):
    name, label = "ring", "context_parallel (ring)"

    def __init__(self, spec: ModelSpec, ctx: RunContext) -> None:
        super().__init__(spec, ctx)
        from torch.distributed.device_mesh import init_device_mesh

        self.mesh = init_device_mesh(ctx.device.type, (ctx.world,), mesh_dim_names=("cp",))
        model = self._build("ring")
        self.fn = torch.compile(sharded_loss(spec, model), backend=ctx.compiler, dynamic=False)
        self._open: list[contextlib.ExitStack] = []

    def prepare(self, ids: Tensor) -> Prepared:
        from torch.distributed.tensor.experimental import context_parallel

        ctx = self.ctx
        _require_divisible(ids.shape[1], 2 * ctx.world, self.name)  # head-tail load balancing
        full = (ids, _positions(ids), shifted_targets(ids))
        n_targets = ids.shape[0] * (ids.shape[1] - 1)

        def forward() -> Tensor:
            # context_parallel shards the buffers in place on entry and must stay open through backward.
            buffers = [t.clone() for t in full]
            stack = contextlib.ExitStack()
            stack.enter_context(context_parallel(self.mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1]))
            try:
                loss = self.fn(*buffers, n_targets)
            except BaseException:
                stack.close()
                raise
            self._open.append(stack)
            return loss

        def backward(loss: Tensor) -> None:
            try:
                loss.backward()
            finally:
                self._open.pop().close()
            sync_grads(self.model, ctx.group, ctx.world, "sum")

        return Prepared(forward, backward, lambda loss: _all_reduced(loss, ctx.group))


METHODS: dict[str, type[Method]] = {
    m.name: m
    for m in (OursSAC, OursSP, OursLongest, OursLongestOffload, DeepSpeedAutoSP, Ulysses, ALST, DDP, Ring)
}


@dataclass
class Reference:
    """One eager single-process step on the whole sequence: the loss and gradients to compare with."""

    spec: ModelSpec
    device: torch.device
    dtype: torch.dtype
    model: nn.Module = field(init=False)

    def __post_init__(self) -> None:
        self.model = build(self.spec).to(self.device, self.dtype)
        self.loss = full_sequence_loss(self.spec, self.model)

    def run(self, ids: Tensor, autocast: torch.dtype | None = None) -> tuple[float, dict[str, Tensor]]:
        self.model.zero_grad(set_to_none=True)
        with torch.autocast(self.device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
            loss = self.loss({"input_ids": ids})
        loss.backward()
        grads = {n: p.grad.detach().clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return loss.item(), grads
