"""``AutoSPStrategy``: sequence parallelism for unmodified Lightning modules.

The strategy wires the pipeline and holds no graph logic itself:
``mesh.py`` (dp x sp mesh) -> ``data.py`` (each rank keeps its slice of the sequence) ->
``compiler/`` (a torch.compile backend that rewrites attention, positions, shifts and losses) ->
DDP (gradients averaged over all ranks; see Note [Loss over sequence shards] in
``compiler/sp_pass.py`` for why that yields single-device gradients).
"""

from __future__ import annotations

import atexit
import math
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.utilities.distributed import _destroy_dist_connection
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.types import STEP_OUTPUT
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_autosp import fsdp
from lightning_autosp.checkpoints import ShardedCheckpoints
from lightning_autosp.compiler.backend import (
    DEFAULT_TILE_BYTES,
    AutoSPBackend,
    Compiler,
    check_backend_options,
)
from lightning_autosp.compiler.context import SPContext
from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.data import RingLayout, SequenceShard, gather_sequence
from lightning_autosp.hang_watch import DEFAULT_HANG_TIMEOUT_S, HangWatch, enable_flight_recorder
from lightning_autosp.mesh import (
    DP,
    SP,
    auto_ulysses_degree,
    build_dp_sp_mesh,
    build_ring_ulysses_mesh,
    check_positive_sp_size,
    check_sp_size,
    check_ulysses_degree,
    check_ulysses_degree_option,
    find_head_counts,
    ring_group_names,
)
from lightning_autosp.meta_init import has_meta_tensors, materialize
from lightning_autosp.metrics import MetricsOverShards
from lightning_autosp.options import (
    check_hang_timeout,
    check_strategy_arguments,
    given_options,
    process_group_timeout,
)
from lightning_autosp.outputs import gather_predictions
from lightning_autosp.planning import planner
from lightning_autosp.sample_check import check_same_sample
from lightning_autosp.steps import CompiledSteps, shard_and_tag

_STEP_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


class AutoSPStrategy(ShardedCheckpoints, DDPStrategy):
    """Data parallel x sequence parallel training by compiler passes.

    Every rank of an sp group receives the same sample and keeps only its slice of the sequence; the
    LightningModule's steps are compiled with a backend that makes attention, positions, masks, the
    causal label shift and the loss exact across the slices. On every rank the loss a step returns is
    the single-device loss of its dp group's batch, and after backward every rank holds the
    single-device gradients averaged over dp groups, as with DDP. With the environment variable
    ``AUTOSP_DEBUG=1``, rank 0 logs :meth:`explain` after the first training step of each sequence layout.

    Args:
        sp_size: ranks per sequence-parallel group (contiguous ranks). Defaults to the devices per node.
            "auto": the smallest that fits a ``max_seq_len``-token step in ``memory_per_device`` bytes
            (default: the CUDA device's memory), from ``lightning_autosp.planning.planner``, planned in
            setup() for the module ``configure_model`` built (Note [Planning sp_size after configure_model] in
            ``planner.py``); logged, and kept as ``strategy.sp_plan``.
        ulysses_degree: how much of sp is Ulysses (all-to-all over heads); the rest, sp_size /
            ulysses_degree, is ring attention (K/V blocks passed around). None: all of sp (sp_size must
            divide the heads); "auto": the largest degree dividing sp_size, the q heads (read from the
            module's configs/attributes) and the devices per node; or an int dividing sp_size.
        ring_layout: which tokens each ring rank holds: "zigzag" (chunks i and 2R-1-i, balancing causal
            attention's work) or "contiguous" (Note [Ring layouts] in ``data.py``).
        seq_dim: the sequence dimension of the batch's token tensors.
        sequence_keys: batch keys whose length defines the sequence (default: ``input_ids``, else
            the first integer tensor); every tensor with that length along ``seq_dim``, and the batch's
            dims before it (or 1), is sharded.
        compiler: "inductor" (default) or "aot_eager" (same passes, no code generation).
        trace_length: the length Dynamo traces the steps at: "shard" (this rank's; one compile per length
            class), "whole" (the sequence's: Python on the length, a chunked scan or a branch, sees what
            one device sees; one compile per length), or "auto": "shard" until a step branches on it.
        sac: sequence-aware activation checkpointing: True (recompute all but attention and
            collectives), "auto" (within 10% of the step's FLOPs), "longest" (every layer rebuilds
            attention and its all-to-alls in backward too, keeping only its input), or False.
        activation_budget: with sac True or "auto", bytes a rank may keep for backward per graph; layers
            rebuild attention as "longest" does, most bytes per FLOP first, until SAC's saves fit.
        offload_activations: what the forward saves for backward waits in host memory (on a GPU, copied
            on a side stream and prefetched in backward; on CPU a functional no-op), as ALST's checkpoints.
        sac_tile_bytes: with SAC on, a row-wise region (an MLP, its rebuild in backward) whose widest
            inner value has at least this many bytes runs over tiles of tokens (default 1 MiB; None: never).
        chunked_loss: compute ``cross_entropy(lm_head(hidden))`` in chunks of ``loss_chunk_tokens``
            tokens (None: chunks of at most 2**26 logits), never holding the whole logits.
        data_parallel: "ddp" (replicas, gradients all-reduced) or "fsdp" (parameters, gradients and
            optimizer state sharded over all dp x sp ranks, ZeRO-3; ``lightning_autosp/fsdp.py``). With
            "fsdp", a model built on the meta device (``trainer.init_module(empty_init=True)``, or
            ``torch.device("meta")`` in ``configure_model``) is sharded before any rank allocates it,
            and each rank initialises only its shard (``lightning_autosp/meta_init.py``).
        fsdp_gather: with "fsdp" only: "per_use" (default) all-gathers each parameter inside the compiled
            step where it is used and again in backward, so only a few layers are whole at a time;
            "per_step" makes the LightningModule one FSDP2 ``fully_shard`` unit, whole for each step.
        offload_parameters: with "fsdp" and "per_step": the shards of parameters, gradients and optimizer
            state live in host memory (FSDP2's ``CPUOffloadPolicy``); the optimizer steps there.
        save_distributed_checkpoint: with "fsdp", save one shard per rank to a directory instead of
            a full checkpoint file assembled on rank 0.
        check_samples: before each step, the ranks of an sp group check that they hold the same sample
            (a checksum of the sequence tensors, all-gathered; Note [Ranks hold the same sample] in
            ``sample_check.py``) and raise naming the ranks that differ. False turns the check off.
        gather_predictions: ``predict_step``'s sequence-sharded outputs are gathered whole on every rank
            (logits [B, S, V], as one device returns them; a collective per step). False keeps each
            rank's shard, [B, S_r, V], for outputs too large to gather (``gather_sequence`` gathers one).
        timeout: process-group timeout, in seconds or as a ``timedelta``; a rank that fails leaves the
            others waiting at most this long.
        hang_timeout: seconds after which ranks that all wait in collectives none can complete (they took
            different collective paths) end with a report of who waits where, instead of at ``timeout``;
            a rank compiling or computing is never taken for a hang (Note [Telling a hang from a slow
            rank] in ``hang_watch.py``). None turns the watch off.
        **ddp_kwargs: passed to ``DistributedDataParallel``.
    """

    strategy_name = "autosp"

    def __init__(
        self,
        sp_size: int | Literal["auto"] | None = None,
        *,
        seq_dim: int = 1,
        sequence_keys: Sequence[str] | None = None,
        compiler: Compiler = "inductor",
        trace_length: Literal["auto", "shard", "whole"] = "auto",
        sac: bool | Literal["auto", "longest"] = True,
        sac_tile_bytes: int | None = DEFAULT_TILE_BYTES,
        activation_budget: int | None = None,
        offload_activations: bool = False,
        ulysses_degree: int | Literal["auto"] | None = None,
        ring_layout: RingLayout = "zigzag",
        chunked_loss: bool = True,
        loss_chunk_tokens: int | None = None,
        data_parallel: fsdp.DataParallel = "ddp",
        fsdp_gather: fsdp.FSDPGather | None = None,
        offload_parameters: bool = False,
        save_distributed_checkpoint: bool = False,
        check_samples: bool = True,
        gather_predictions: bool = True,
        max_seq_len: int | None = None,
        memory_per_device: int | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float | None = default_pg_timeout,
        hang_timeout: float | None = DEFAULT_HANG_TIMEOUT_S,
        start_method: str = "popen",
        **ddp_kwargs: Any,
    ) -> None:
        self._options = given_options(locals())
        timeout = process_group_timeout(timeout)
        self.hang_timeout = check_hang_timeout(hang_timeout)
        self._hang_watch: HangWatch | None = None
        check_strategy_arguments(
            seq_dim=seq_dim,
            sequence_keys=sequence_keys,
            save_distributed_checkpoint=save_distributed_checkpoint,
            check_samples=check_samples,
            gather_predictions=gather_predictions,
            process_group_backend=process_group_backend,
            start_method=start_method,
            ring_layout=ring_layout,
            trace_length=trace_length,
            parallel_devices=parallel_devices,
            plugins={
                "accelerator": accelerator,
                "cluster_environment": cluster_environment,
                "checkpoint_io": checkpoint_io,
                "precision_plugin": precision_plugin,
            },
            ddp_kwargs=ddp_kwargs,
        )
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
        self._auto_sp = planner.check_auto_sp_options(sp_size, max_seq_len, memory_per_device)
        self._max_seq_len, self._memory_per_device = max_seq_len, memory_per_device
        if self._auto_sp:
            sp_size = None  # chosen in setup(), once configure_model has built the module
        self.sp_plan: planner.PlanOption | None = None
        if sp_size is not None:
            check_positive_sp_size(sp_size)
        check_ulysses_degree_option(ulysses_degree)
        self._ulysses_option = ulysses_degree
        self._ulysses_degree: int | None = None if ulysses_degree == "auto" else ulysses_degree
        self.ring_layout: RingLayout = ring_layout
        self._ring_mesh: DeviceMesh | None = None
        self.loss_options = {"chunked_loss": chunked_loss, "loss_chunk_tokens": loss_chunk_tokens}
        # what every AutoSPBackend this strategy builds is given
        self._backend_options = {
            "sac_tile_bytes": sac_tile_bytes,
            "activation_budget": activation_budget,
            "offload_activations": offload_activations,
        }
        check_backend_options(compiler, sac, **self.loss_options, **self._backend_options)
        self._sp_size = sp_size
        self.seq_dim = seq_dim
        self.sequence_keys = tuple(sequence_keys) if sequence_keys else None
        self.compiler: Compiler = compiler
        self.trace_length, self._unsharded = trace_length, None
        self.sac = sac
        self.sequence_shard: SequenceShard | None = None
        self._device_mesh: DeviceMesh | None = None
        self._sequence_tags = SequenceTags()
        self._steps = CompiledSteps(self._backend, self._sp_context, lambda: self.sequence_shard, self._whole)
        self._metrics = MetricsOverShards(  # Note [Metrics over sequence shards]
            self._sequence_tags,
            lambda: self.sequence_shard,
            lambda: self.device_mesh.get_group(SP),
            lambda: self.device_mesh.get_group(DP),
        )
        fsdp.check_data_parallel(
            data_parallel, save_distributed_checkpoint, ddp_kwargs, fsdp_gather, offload_parameters
        )
        self.data_parallel: fsdp.DataParallel = data_parallel
        self.fsdp_gather: fsdp.FSDPGather = fsdp_gather or "per_use"
        self.offload_parameters = offload_parameters
        self._save_distributed_checkpoint = save_distributed_checkpoint
        self.check_samples = check_samples
        self.gather_predictions = gather_predictions

    @property
    def options(self) -> dict[str, Any]:
        """The options this strategy was made with, as keyword arguments (plugins left out): ``autosp
        verify`` makes the same strategy again for its own run."""
        return dict(self._options)

    @property
    def sp_size(self) -> int:
        if self._sp_size is None and self._auto_sp:
            raise RuntimeError(
                "sp_size='auto' is chosen in setup(), after configure_model; read strategy.sp_size from "
                "on_fit_start (or later) on."
            )
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
    def ulysses_degree(self) -> int:
        """Ranks of an sp group that exchange heads by all-to-all; the rest of sp is the ring."""
        if self._ulysses_option is None:
            return self.sp_size
        if self._ulysses_degree is None:
            raise RuntimeError("ulysses_degree='auto' is resolved in setup(), from the module's heads.")
        return self._ulysses_degree

    @property
    def ring_degree(self) -> int:
        return self.sp_size // self.ulysses_degree

    @property
    def device_mesh(self) -> DeviceMesh:
        if self._device_mesh is None:
            raise RuntimeError("Accessing the device mesh before processes have initialized is not allowed.")
        return self._device_mesh

    @override
    def set_world_ranks(self) -> None:
        super().set_world_ranks()
        if self._auto_sp and self._sp_size is None:
            return  # planned in setup(), which checks what it chooses
        self._check_sp_layout()

    def _check_sp_layout(self) -> None:
        # Before any collective, so a bad sp_size fails on every rank alike.
        check_sp_size(self.world_size, self.sp_size)
        if isinstance(self._ulysses_option, int):
            check_ulysses_degree(self.sp_size, self._ulysses_option)

    @override
    def setup_distributed(self) -> None:
        if self.hang_timeout is not None:
            enable_flight_recorder()  # read when the process group is created
        super().setup_distributed()
        # An undestroyed gloo group's threads can abort the process at exit (pytorch/pytorch#190489), and
        # Lightning's exit handler is for NCCL only. A group torch holds in C++ outlives it (README: Limits).
        atexit.unregister(_destroy_dist_connection)  # once per process, however many Trainer runs
        atexit.register(_destroy_dist_connection)
        if self._sp_size is not None or not self._auto_sp:
            self._build_dp_sp_mesh()

    def _build_dp_sp_mesh(self) -> None:
        self._device_mesh = build_dp_sp_mesh(
            self.root_device.type, self.world_size, self.sp_size, self._timeout
        )

    def _plan_sp_size(self) -> None:
        """sp_size="auto": the smallest that fits, for the module configure_model built."""
        self.sp_plan = planner.auto_sp_size(
            self.lightning_module,
            max_seq_len=self._max_seq_len,
            memory_per_device=self._memory_per_device,
            device=self.root_device,
            devices=self.num_nodes * self.num_processes,
            gpus_per_node=self.num_processes,
            sac=self.sac,
            data_parallel=self.data_parallel,
            fsdp_gather=self.fsdp_gather,
            compiler=self.compiler,
            precision=self.precision_plugin.precision,
            ulysses_degree=self._ulysses_option,
            offload_activations=self._backend_options["offload_activations"],
            offload_parameters=self.offload_parameters,
            **self.loss_options,
        )
        self._sp_size = self.sp_plan.setup.sp_size
        self._check_sp_layout()
        self._build_dp_sp_mesh()

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` with data_parallel="fsdp" builds on the meta device;
        setup() shards the module there, then each rank materialises its shard (``meta_init.py``)."""
        if not (empty_init and self.data_parallel == "fsdp"):
            with super().tensor_init_context(empty_init):
                yield
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield

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
        if self.check_samples:  # Note [Ranks hold the same sample]
            check_same_sample(
                batch,
                group=self.device_mesh.get_group(SP),
                seq_dim=self.seq_dim,
                sequence_keys=self.sequence_keys,
                device=self.root_device,
                dp_rank=self.dp_rank,
                sp_size=self.sp_size,
            )
        self._unsharded = batch if self.trace_length == "auto" else None  # see _whole
        return self._shard_and_tag(batch, whole=self.trace_length == "whole")

    def _shard_and_tag(self, batch: Any, whole: bool) -> Any:
        batch, self.sequence_shard = shard_and_tag(
            batch, self._sequence_tags, whole, world=self.sp_size, rank=self.sp_rank, seq_dim=self.seq_dim,
            sequence_keys=self.sequence_keys, ring_degree=self.ring_degree, ring_layout=self.ring_layout,
        )  # fmt: skip
        return batch

    def _whole(self) -> Any:
        """With trace_length="auto", once a step branched on the length: the batch at hand whole, tagged so,
        and whole batches from now on (Note [Tracing at the whole sequence's length]). Else None."""
        if self.trace_length != "auto" or self._unsharded is None:
            return None
        self.trace_length = "whole"
        return self._shard_and_tag(self._unsharded, whole=True)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self._sp_size is None and self._auto_sp:
            self._plan_sp_size()  # Note [Planning sp_size after configure_model]
        # Compile the steps, not the module: the loss written in training_step is then inside the
        # compiled region, and checkpoints keep plain parameter names (no ``_orig_mod``).
        self._setup_ring()
        if self.hang_timeout is not None and self.world_size > 1 and self._hang_watch is None:
            self._hang_watch = HangWatch(self.hang_timeout).start()
        self._steps.install(self.lightning_module)
        self._metrics.install(self.lightning_module)
        if self.data_parallel == "fsdp":
            mesh = fsdp.build_world_mesh(self.root_device.type, self.world_size)
            fsdp.setup_fully_sharded(
                self,
                trainer,
                mesh,
                self.fsdp_gather,
                offload=self.offload_parameters,
                on_meta=has_meta_tensors(self.model),
                materialize=materialize,
            )
            return
        if has_meta_tensors(self.model):  # every rank holds the whole model: materialise it all
            materialize(self.model, self.root_device)
        super().setup(trainer)

    def _setup_ring(self) -> None:
        """Resolve ulysses_degree="auto" (the module exists only now, after configure_model) and split
        the sp groups into ring x Ulysses sub-groups when sp is more than the Ulysses degree."""
        if self._ulysses_option == "auto" and self._ulysses_degree is None:
            heads = find_head_counts(self.lightning_module)
            if not heads:
                raise ValueError(
                    "ulysses_degree='auto' found no attention head count on the module (a config's "
                    "num_attention_heads, or a num_heads/n_head/heads attribute). Pass ulysses_degree=<int>."
                )
            self._ulysses_degree = auto_ulysses_degree(self.sp_size, math.gcd(*heads), self.num_processes)
        if self.ring_degree > 1 and self._ring_mesh is None:
            self._ring_mesh = build_ring_ulysses_mesh(
                self.root_device.type, self.world_size, self.sp_size, self.ulysses_degree, self._timeout
            )

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        self._hang_watch = self._hang_watch and self._hang_watch.stop()
        self._steps.uninstall(module)
        self._metrics.uninstall()
        if self.data_parallel == "fsdp" or (module is not None and has_meta_tensors(module)):
            # As Lightning's ModelParallelStrategy: sharded parameters stay on their device (moving
            # them to the CPU would swap every DTensor parameter the optimizer still refers to), and
            # a module that failed before it was materialised cannot move at all.
            assert self.cluster_environment is not None and self.accelerator is not None
            self.cluster_environment.teardown()
            self.precision_plugin.teardown()
            self.accelerator.teardown()
            self.checkpoint_io.teardown()
            return
        super().teardown()

    # When the LightningModule is an FSDP2 unit (fsdp_gather="per_step"), every step is called through
    # its ``__call__`` (Lightning's forward redirection): FSDP2's hooks, which are graph breaks, then
    # run around the compiled step instead of inside it (Note [FSDP units under a compiled step]).

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._call_step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._call_step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> STEP_OUTPUT:
        return self._call_step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        output = self._call_step("predict_step", *args, **kwargs)
        if self.sequence_shard is None or not self.gather_predictions:
            return output
        return gather_predictions(
            output, self._sequence_tags, self.sequence_shard, self.device_mesh.get_group(SP)
        )

    def _call_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(self.model, FSDPModule):  # DDP wraps the module: Lightning redirects already
            return getattr(super(), name)(*args, **kwargs)
        with getattr(self.precision_plugin, _STEP_CONTEXTS[name])():
            return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

    # Checkpoints under data_parallel="fsdp", as Lightning's ModelParallelStrategy does them: the
    # strategy loads weights and optimizer states itself once they are sharded, after setup.

    def gather_sequence(self, tensor: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice of a sequence-sharded output (e.g. from ``predict_step``) -> the whole sequence.

        Every rank of the sp group must call it (it is a collective); shards may be uneven.
        Shapes: [B, S_r, ...] -> [B, S, ...] along ``dim``.
        """
        if self.sequence_shard is None:
            return tensor
        return gather_sequence(tensor, self.sequence_shard, self.device_mesh.get_group(SP), dim)

    def explain(self) -> str:
        """What the compiler did, per compiled graph: attention found, all-to-alls, rewrites, layouts."""
        return self._steps.explain()

    @property
    def backends(self) -> Mapping[SequenceShard | None, AutoSPBackend]:
        """The compile backend of each sequence layout seen so far (their reports feed ``explain``)."""
        return self._steps.backends

    def backend_for(self, shard: SequenceShard | None) -> AutoSPBackend:
        """The compile backend for one sequence layout (Dynamo keeps one compiled graph per backend)."""
        return self._steps.backend_for(shard)

    @property
    def compiles(self) -> Mapping[tuple[str, SequenceShard | None], int]:
        """How many times each (step name, sequence layout) was compiled: 1 unless a guard failed."""
        return self._steps.compiles

    def _sp_context(self, shard: SequenceShard) -> SPContext:
        ring = ring_group_names(self._ring_mesh)
        return SPContext(shard, self.device_mesh.get_group(SP).group_name, self.seq_dim, **ring)

    def _backend(self, context: SPContext | None) -> AutoSPBackend:
        options = {"compiler": self.compiler, "sac": self.sac, **self.loss_options, **self._backend_options}
        return AutoSPBackend(context, tags=self._sequence_tags, **options)


StrategyRegistry.register(
    AutoSPStrategy.strategy_name,
    AutoSPStrategy,
    description="Sequence parallelism by compiler passes (lightning_autosp)",
)
