"""``AutoSPStrategy``: sequence parallelism for unmodified Lightning modules.

The strategy wires the pipeline and holds no graph logic itself:
``mesh.py`` (dp x sp mesh) -> ``data.py`` (each rank keeps its slice of the sequence) ->
``compiler/`` (a torch.compile backend that rewrites attention, positions, shifts and losses) ->
DDP (gradients averaged over all ranks; see Note [Loss over sequence shards] in
``compiler/sp_pass.py`` for why that yields single-device gradients).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_autosp.compiler.backend import (
    AutoSPBackend,
    Compiler,
    active_dispatch_mode,
    check_backend_options,
    frames_not_compiled,
)
from lightning_autosp.compiler.sp_pass import SPContext
from lightning_autosp.data import SequenceShard, shard_batch
from lightning_autosp.mesh import SP, build_dp_sp_mesh, check_positive_sp_size, check_sp_size

_STEPS = ("training_step", "validation_step", "test_step", "predict_step")
_LOGGING = ("log", "log_dict")


class AutoSPStrategy(DDPStrategy):
    """Data parallel x sequence parallel training by compiler passes.

    Every rank of an sp group receives the same sample and keeps only its slice of the sequence; the
    LightningModule's steps are compiled with a backend that makes attention, positions, masks, the
    causal label shift and the loss exact across the slices. On every rank the loss a step returns is
    the single-device loss of its dp group's batch, and after backward every rank holds the
    single-device gradients averaged over dp groups, as with DDP. With the environment variable
    ``AUTOSP_DEBUG=1``, rank 0 logs :meth:`explain` after the first training step of each sequence layout.

    Args:
        sp_size: ranks per sequence-parallel group (contiguous ranks). Defaults to the devices per node.
        seq_dim: the sequence dimension of the batch's token tensors.
        sequence_keys: batch keys whose length defines the sequence (default: ``input_ids``, else
            the first integer tensor); every tensor with that length along ``seq_dim`` is sharded.
        compiler: "inductor" (default) or "aot_eager" (same passes, no code generation).
        sac: sequence-aware activation checkpointing: True (recompute all but attention and
            collectives), "auto" (within 10% of the step's FLOPs, from a FLOP model), or False.
        timeout: process-group timeout; a rank that fails leaves the others waiting at most this long.
        **ddp_kwargs: passed to ``DistributedDataParallel``.
    """

    strategy_name = "autosp"

    def __init__(
        self,
        sp_size: int | None = None,
        *,
        seq_dim: int = 1,
        sequence_keys: Sequence[str] | None = None,
        compiler: Compiler = "inductor",
        sac: bool | str = True,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            **ddp_kwargs,
        )
        if sp_size is not None:
            check_positive_sp_size(sp_size)
        check_backend_options(compiler, sac)
        self._sp_size = sp_size
        self.seq_dim = seq_dim
        self.sequence_keys = tuple(sequence_keys) if sequence_keys else None
        self.compiler: Compiler = compiler
        self.sac = sac
        self.sequence_shard: SequenceShard | None = None
        self._device_mesh: DeviceMesh | None = None
        self._backends: dict[SequenceShard | None, AutoSPBackend] = {}
        self._original_steps: dict[str, Callable] = {}

    @property
    def sp_size(self) -> int:
        return self._sp_size or self.num_processes

    @property
    def dp_size(self) -> int:
        return self.world_size // self.sp_size

    @property
    def sp_rank(self) -> int:
        return self.global_rank % self.sp_size

    @property
    def dp_rank(self) -> int:
        return self.global_rank // self.sp_size

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._device_mesh

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        # Checked here, before the process group exists, so a bad sp_size fails on every rank alike.
        check_sp_size(self.world_size, self.sp_size)

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._device_mesh = build_dp_sp_mesh(
            self.root_device.type, self.world_size, self.sp_size, self._timeout
        )

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # The ranks of an sp group share each sample; only dp groups draw different ones.
        return {"num_replicas": self.dp_size, "rank": self.dp_rank}

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device, dataloader_idx)
        if self.sp_size == 1:
            self.sequence_shard = None
            return batch
        batch, self.sequence_shard = shard_batch(
            batch,
            world=self.sp_size,
            rank=self.sp_rank,
            seq_dim=self.seq_dim,
            sequence_keys=self.sequence_keys,
        )
        return batch

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # Compile the steps, not the module: the loss written in training_step is then inside the
        # compiled region, and checkpoints keep plain parameter names (no ``_orig_mod``).
        self._compile_steps(self.lightning_module)
        super().setup(trainer)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if module is not None:
            for name in self._original_steps:
                module.__dict__.pop(name, None)
        self._original_steps.clear()
        super().teardown()

    def gather_sequence(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a sequence-sharded output (e.g. from ``predict_step``) -> the whole sequence.

        Every rank of the sp group must call it (it is a collective); shards may be uneven.
        Shapes: [B, S_r, ...] -> [B, S, ...] along ``dim``.
        """
        shard = self.sequence_shard
        if shard is None:
            return tensor
        longest = max(shard.seq_lens)
        padding = list(tensor.shape)
        padding[dim] = longest - tensor.shape[dim]
        padded = torch.cat([tensor, tensor.new_zeros(padding)], dim=dim).contiguous()
        gathered = [torch.empty_like(padded) for _ in shard.seq_lens]
        torch.distributed.all_gather(gathered, padded, group=self.device_mesh.get_group(SP))
        return torch.cat(
            [part.narrow(dim, 0, length) for part, length in zip(gathered, shard.seq_lens)], dim=dim
        )

    def explain(self) -> str:
        """What the compiler did, per compiled graph: attention found, all-to-alls, rewrites."""
        lines = []
        for shard, backend in self._backends.items():
            layout = (
                "no sequence parallelism"
                if shard is None
                else f"sequence {shard.global_len} -> {shard.seq_lens}"
            )
            for index, report in enumerate(backend.reports):
                lines.append(f"graph {index} ({layout}):")
                lines.extend(f"  {line}" for line in report.lines())
            lines.extend(f"{report.line()}" for report in backend.sac_reports)
        return "\n".join(lines) if lines else "Nothing compiled yet."

    def backend_for(self, shard: SequenceShard | None) -> AutoSPBackend:
        """The compile backend for one sequence layout (Dynamo keeps one compiled graph per backend)."""
        if shard not in self._backends:
            context = (
                None
                if shard is None
                else SPContext(shard, self.device_mesh.get_group(SP).group_name, self.seq_dim)
            )
            self._backends[shard] = AutoSPBackend(context, compiler=self.compiler, sac=self.sac)
        return self._backends[shard]

    def _compile_steps(self, module: pl.LightningModule) -> None:
        # Dynamo cannot trace Lightning's logging; calling it from a compiled step becomes a graph break.
        for name in _LOGGING:
            self._original_steps[name] = getattr(module, name)
            setattr(module, name, torch._dynamo.disable(getattr(module, name)))
        for name in _STEPS:
            step = getattr(module, name, None)
            if step is None or name in self._original_steps:
                continue
            self._original_steps[name] = step
            setattr(module, name, self._make_compiled_step(name, step))

    def _make_compiled_step(self, name: str, step: Callable) -> Callable:
        # The global sequence layout is baked into the compiled graph, and shards of one local
        # length can come from different global lengths (61 and 62 tokens both give rank 0 31
        # tokens), so each layout gets its own backend, which Dynamo guards on.
        compiled: dict[SequenceShard | None, Callable] = {}

        @functools.wraps(step)
        def run(*args: Any, **kwargs: Any) -> Any:
            if torch.compiler.is_compiling():
                # Called from another compiled step (validation_step calling self.training_step):
                # Dynamo inlines the original step into the caller's graph.
                return step(*args, **kwargs)
            shard = self.sequence_shard
            mode = active_dispatch_mode()
            if shard is not None and mode is not None:
                raise RuntimeError(
                    f"{name} was called under {type(mode).__name__}, a TorchDispatchMode under which "
                    "torch.compile runs code eagerly, i.e. without sequence parallelism. Measure outside "
                    "the step (e.g. MemoryMonitor, torch.cuda.max_memory_allocated) instead."
                )
            backend = self.backend_for(shard)
            first_call = shard not in compiled
            if first_call:
                compiled[shard] = torch.compile(step, backend=backend, dynamic=False)
            skipped = frames_not_compiled()
            output = compiled[shard](*args, **kwargs)
            if shard is not None:
                _check_sequence_parallel_applied(name, backend, frames_not_compiled() - skipped)
            if first_call and name == "training_step" and os.environ.get("AUTOSP_DEBUG") == "1":
                rank_zero_info(
                    f"AutoSP (AUTOSP_DEBUG=1), after the first {name} of this layout:\n{self.explain()}"
                )
            return output

        return run


def _check_sequence_parallel_applied(step_name: str, backend: AutoSPBackend, skipped_frames: int) -> None:
    # Every rank runs the same graphs, so every rank raises here alike: nobody is left in a collective.
    if skipped_frames:
        raise RuntimeError(
            f"torch.compile could not compile part of {step_name} ({skipped_frames} frame(s) fell back to "
            "eager, e.g. a graph break inside a for loop), and code outside compiled graphs runs without "
            "sequence parallelism. Remove the graph break (TORCH_LOGS=graph_breaks shows where) or move it "
            "out of the loop."
        )
    if not backend.reports:
        raise RuntimeError(
            f"torch.compile ran {step_name} without calling the AutoSP backend (compilation disabled, or "
            "Dynamo's recompile limit reached after many distinct sequence lengths), so sequence "
            "parallelism was not applied. Bucket or pad sequence lengths to a few fixed values."
        )
    if backend.attention_count == 0:
        raise RuntimeError(
            f"No attention call was found in the compiled graphs of {step_name}, so sequence parallelism "
            "cannot be applied. Compute attention with torch.nn.functional.scaled_dot_product_attention "
            "(HF: attn_implementation='sdpa'); hand-written softmax(QK^T)V attention is not recognized."
        )


StrategyRegistry.register(
    AutoSPStrategy.strategy_name,
    AutoSPStrategy,
    description="Sequence parallelism by compiler passes (lightning_autosp)",
)
