"""AutoSPStrategy configuration and checks that need no process group."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning_utilities.core.rank_zero import rank_zero_only

import lightning_autosp
from lightning_autosp.compiler.backend import AutoSPBackend
from lightning_autosp.compiler.sp_pass import SPReport
from lightning_autosp.mesh import check_sp_size
from lightning_autosp.steps import EagerEvidence, check_sequence_parallel_applied
from lightning_autosp.strategy import AutoSPStrategy

CPU = torch.device("cpu")


@pytest.fixture(autouse=True)
def _restore_rank(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """set_world_ranks() writes the process-wide rank_zero_only.rank; keep it for the other tests."""
    monkeypatch.setattr(rank_zero_only, "rank", getattr(rank_zero_only, "rank", 0), raising=False)
    for name in ("LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    yield


def strategy(num_devices: int, **kwargs) -> AutoSPStrategy:
    return AutoSPStrategy(
        parallel_devices=[CPU] * num_devices, cluster_environment=LightningEnvironment(), **kwargs
    )


# --------------------------------------------------------------------------------------------------
# sp_size


def test_check_sp_size_lists_divisors() -> None:
    with pytest.raises(
        ValueError, match=r"sp_size=3 must divide the world size \(4 processes\).*\[1, 2, 4\]"
    ):
        check_sp_size(4, 3)
    check_sp_size(4, 2)
    check_sp_size(4, 4)
    check_sp_size(6, 3)


@pytest.mark.parametrize("sp_size", [0, -2, True, 2.0, "2"])
def test_check_sp_size_positive_int(sp_size) -> None:
    with pytest.raises(ValueError, match="sp_size must be a positive integer"):
        check_sp_size(4, sp_size)


@pytest.mark.parametrize("sp_size", [0, -1, True])
def test_strategy_rejects_bad_sp_size(sp_size) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        AutoSPStrategy(sp_size=sp_size)


def test_strategy_rejects_unknown_compiler() -> None:
    with pytest.raises(ValueError, match="compiler='tvm'"):
        AutoSPStrategy(compiler="tvm")
    with pytest.raises(ValueError, match="compiler='tvm'"):
        AutoSPBackend(None, compiler="tvm")


def test_registered() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    assert lightning_autosp.AutoSPStrategy is AutoSPStrategy
    assert "autosp" in StrategyRegistry
    assert StrategyRegistry["autosp"]["strategy"] is AutoSPStrategy


def test_defaults() -> None:
    s = AutoSPStrategy()
    assert (s.seq_dim, s.sequence_keys, s.compiler, s.sac) == (1, None, "inductor", True)
    assert AutoSPStrategy(sequence_keys=["input_ids", "labels"]).sequence_keys == ("input_ids", "labels")


def test_sp_size_must_divide_world_before_any_process_group() -> None:
    s = strategy(3, sp_size=2)
    with pytest.raises(ValueError, match=r"sp_size=2 must divide the world size \(3 processes\).*\[1, 3\]"):
        s.set_world_ranks()
    assert not torch.distributed.is_initialized()


def test_device_mesh_before_setup() -> None:
    with pytest.raises(RuntimeError, match="before processes have initialized"):
        _ = strategy(2, sp_size=2).device_mesh


# --------------------------------------------------------------------------------------------------
# ranks


def test_ranks_world_4_sp_2(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    s = strategy(4, sp_size=2, check_samples=False)  # the sample check all-gathers: no process group here
    s.set_world_ranks()
    assert (s.global_rank, s.world_size) == (3, 4)
    assert (s.sp_size, s.sp_rank, s.dp_size, s.dp_rank) == (2, 1, 2, 1)
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_ranks_set_on_the_cluster_environment() -> None:
    env = LightningEnvironment()
    env.set_global_rank(3)
    env.set_world_size(4)
    s = AutoSPStrategy(sp_size=2, parallel_devices=[CPU] * 4, cluster_environment=env)
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    env.set_global_rank(2)
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}
    env.set_global_rank(1)
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 0}


def test_sp_size_defaults_to_devices_per_node(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NODE_RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    s = strategy(2)
    s.num_nodes = 2
    s.set_world_ranks()
    assert (s.global_rank, s.world_size) == (2, 4)
    assert (s.sp_size, s.sp_rank, s.dp_size, s.dp_rank) == (2, 0, 2, 1)
    assert s.distributed_sampler_kwargs == {"num_replicas": 2, "rank": 1}


def test_sp_size_equal_to_world_means_one_dp_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "2")
    s = strategy(4, sp_size=4)
    s.set_world_ranks()
    assert s.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert s.sp_rank == 2


# --------------------------------------------------------------------------------------------------
# the post-compile check


def _backend(*reports: SPReport) -> AutoSPBackend:
    backend = AutoSPBackend(None, compiler="aot_eager")
    backend.reports.extend(reports)
    return backend


def test_check_passes_with_attention() -> None:
    check_sequence_parallel_applied(
        "training_step", _backend(SPReport(), SPReport(attention=["sdpa"])), EagerEvidence(0)
    )


def test_a_step_without_attention_is_fine() -> None:
    # every op that mixes tokens is rewritten or refused by the analysis, attention or not (a sort, a scan)
    check_sequence_parallel_applied("training_step", _backend(SPReport(), SPReport()), EagerEvidence(0))


def test_check_backend_never_called() -> None:
    with pytest.raises(RuntimeError, match="without calling the AutoSP backend"):
        check_sequence_parallel_applied("validation_step", _backend(), EagerEvidence(0))


_CALL = "Encountered graph break when attempting to trace CALL: a function call, e.g. f(x, y):\n\n"
_ITEM = _CALL + "Data dependent operator\n  Explanation: Operator `aten._local_scalar_dense.default` has ..."
_TOLIST = _CALL + "Unsupported Tensor.tolist() call\n  Explanation: ..."


def test_check_frames_fell_back_to_eager() -> None:
    """Frames Dynamo gave up on pass only where nothing eager can have read sequence data unseen (Note
    [Eager code between graphs]): a break the watch cannot see into, or a length handed to eager code."""
    backend = _backend(SPReport(attention=["sdpa"]))
    with pytest.raises(RuntimeError, match=r"training_step \(2 frame\(s\) fell back to eager") as error:
        check_sequence_parallel_applied("training_step", backend, EagerEvidence(2, blind_breaks=[_TOLIST]))
    assert "a torch call the watch cannot see into (Unsupported Tensor.tolist() call)" in str(error.value)
    with pytest.raises(RuntimeError, match="a sequence length handed to eager code .sym_size_int of graph 0"):
        check_sequence_parallel_applied(
            "training_step", backend, EagerEvidence(2, length_outputs=["sym_size_int of graph 0"])
        )
    # item() reads a one-element value, which the pass hands on replicated: the step stands
    check_sequence_parallel_applied("training_step", backend, EagerEvidence(2, blind_breaks=[_ITEM]))


def test_check_eager_calls_on_sequence_data() -> None:
    backend = _backend(SPReport(attention=["sdpa"]))
    call = "mean on a tensor of layout shard(1) at /home/me/train.py:7 in helper"
    with pytest.raises(RuntimeError, match="computed on this rank's part of the sequence outside") as error:
        check_sequence_parallel_applied("training_step", backend, EagerEvidence(0, eager_calls=[call]))
    assert call in str(error.value)


def test_explain_before_compiling() -> None:
    assert AutoSPStrategy(sp_size=2).explain() == "Nothing compiled yet."


# --------------------------------------------------------------------------------------------------
# batches


def test_batch_to_device_keeps_this_sp_ranks_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    s = strategy(4, sp_size=2, check_samples=False)  # the sample check all-gathers: no process group here
    s.set_world_ranks()
    ids = torch.arange(22).reshape(2, 11)
    batch = s.batch_to_device({"input_ids": ids, "labels": ids.clone()})
    assert torch.equal(batch["input_ids"], ids[:, 6:])  # sp rank 1 of (6, 5)
    assert torch.equal(batch["labels"], ids[:, 6:])
    assert s.sequence_shard is not None and s.sequence_shard.seq_lens == (6, 5) and s.sequence_shard.rank == 1


def test_batch_to_device_tags_a_sequence_on_a_later_dim(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen2-VL's position_ids [B, 3, S]: sharded along dim 2 and tagged so, not left whole on every rank."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    s = strategy(2, sp_size=2, check_samples=False)
    s.set_world_ranks()
    ids, positions = torch.arange(20).reshape(2, 10), torch.arange(60).reshape(2, 3, 10)
    batch = s.batch_to_device({"input_ids": ids, "position_ids": positions})
    assert torch.equal(batch["position_ids"], positions[..., 5:])
    tags = {key: s._sequence_tags.get(batch[key]) for key in batch}
    assert (tags["input_ids"].layout.dims, tags["position_ids"].layout.dims) == ((1,), (2,))
    assert tags["position_ids"].layout.is_shard and tags["position_ids"].global_sizes == (10,)


def test_batch_to_device_without_sequence_parallelism() -> None:
    s = strategy(1, sp_size=1)
    s.set_world_ranks()
    ids = torch.arange(22).reshape(2, 11)
    assert torch.equal(s.batch_to_device({"input_ids": ids})["input_ids"], ids)
    assert s.sequence_shard is None


def test_a_step_under_a_dispatch_mode_is_refused() -> None:
    """Dynamo silently runs compiled code eagerly under a TorchDispatchMode: the step must refuse."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_autosp.data import SequenceShard

    strategy = AutoSPStrategy(sp_size=2, compiler="aot_eager")
    strategy.sequence_shard = SequenceShard.balanced(8, 2, 0)
    step = strategy._steps.compiled("training_step", lambda batch: batch.sum())
    with FlopCounterMode(display=False), pytest.raises(RuntimeError, match="FlopCounterMode"):
        step(torch.ones(2, 4))


# --------------------------------------------------------------------------------------------------
# every argument is checked when the strategy is made


@pytest.mark.parametrize(
    ("timeout", "expected"),
    [
        (60, timedelta(seconds=60)),
        (2.5, timedelta(seconds=2.5)),
        (timedelta(minutes=5), timedelta(minutes=5)),
        (None, None),
    ],
)
def test_timeout_in_seconds_or_as_a_timedelta(timeout: object, expected: timedelta | None) -> None:
    assert AutoSPStrategy(timeout=timeout)._timeout == expected


BAD_ARGUMENTS = [
    ({"timeout": "60"}, TypeError, r"timeout='60' is not a duration; pass seconds \(timeout=60\)"),
    ({"timeout": 0}, ValueError, "timeout=0 must be a positive, finite time"),
    ({"timeout": float("inf")}, ValueError, "timeout=inf must be a positive, finite time"),
    ({"seq_dim": "1"}, ValueError, "seq_dim='1' must be the index of the sequence dimension"),
    ({"seq_dim": -1}, ValueError, "seq_dim=-1 must be the index"),
    ({"sequence_keys": "input_ids"}, TypeError, r"sequence_keys=\['input_ids'\]"),
    ({"sequence_keys": [1]}, TypeError, "must be a list of batch keys"),
    ({"save_distributed_checkpoint": "yes"}, TypeError, "save_distributed_checkpoint='yes' must be True"),
    ({"gather_predictions": "no"}, TypeError, "gather_predictions='no' must be True"),
    ({"process_group_backend": 1}, TypeError, "process_group_backend=1 must be a backend name"),
    ({"start_method": "thread"}, ValueError, r"start_method='thread' is not available here; use one of \["),
    ({"parallel_devices": ["cpu"]}, TypeError, r"parallel_devices=\['cpu'\] must be a list of torch.device"),
    (
        {"accelerator": "gpu"},
        TypeError,
        r"accelerator='gpu' must be an instance of Accelerator.*Trainer\(acc",
    ),
    ({"precision_plugin": "bf16-mixed"}, TypeError, r"Trainer\(precision='bf16-mixed'\)"),
    (
        {"find_unused_parameter": True},
        TypeError,
        r"unknown options \['find_unused_parameter'\].*'find_unused_parameters'",
    ),
    ({"device_ids": [0]}, TypeError, r"unknown options \['device_ids'\]"),
    ({"trace_length": "global"}, ValueError, r"trace_length='global' is not supported; use 'shard'"),
    ({"ring_layout": "striped"}, ValueError, r"ring_layout='striped' is not supported"),
]


@pytest.mark.parametrize(("kwargs", "error", "match"), BAD_ARGUMENTS)
def test_a_bad_argument_fails_when_the_strategy_is_made(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        AutoSPStrategy(sp_size=2, **kwargs)


def test_ddp_and_ddp_strategy_options_are_accepted() -> None:
    s = AutoSPStrategy(sp_size=2, find_unused_parameters=True, static_graph=True, ddp_comm_hook=None)
    assert s._ddp_kwargs == {"find_unused_parameters": True, "static_graph": True}


@pytest.mark.parametrize(
    "options",
    [{}, {"data_parallel": "fsdp"}, {"data_parallel": "fsdp", "fsdp_gather": "per_use"}],
)
def test_offload_parameters_names_the_fsdp_setup_it_needs(options) -> None:
    with pytest.raises(
        ValueError, match=r"needs AutoSPStrategy\(data_parallel='fsdp', fsdp_gather='per_step'\)"
    ):
        AutoSPStrategy(sp_size=2, offload_parameters=True, **options)
    with pytest.raises(TypeError, match="offload_parameters='yes' must be True or False"):
        AutoSPStrategy(sp_size=2, offload_parameters="yes")
