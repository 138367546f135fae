"""data_parallel="fsdp": option checks, unit selection and parameter sharding, in one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from lightning_autosp import AutoSPStrategy
from lightning_autosp.fsdp import check_user_sharding, local_state_bytes, shard_parameters
from lightning_autosp.meta_init import materialize
from tests.distributed.modules import VOCAB, GPTModule, LlamaModule, TinyGPT


def test_unknown_data_parallel_is_refused():
    with pytest.raises(ValueError, match="data_parallel='zero3' is not supported; use 'ddp' or 'fsdp'"):
        AutoSPStrategy(sp_size=2, data_parallel="zero3")


def test_distributed_checkpoints_need_fsdp():
    with pytest.raises(ValueError, match="save_distributed_checkpoint=True needs sharded state"):
        AutoSPStrategy(sp_size=2, save_distributed_checkpoint=True)
    strategy = AutoSPStrategy(sp_size=2, data_parallel="fsdp", save_distributed_checkpoint=True)
    assert strategy.restore_checkpoint_after_setup and not strategy.lightning_restore_optimizer


def test_ddp_options_are_refused_with_fsdp():
    with pytest.raises(ValueError, match=r"\['bucket_cap_mb'\] are DistributedDataParallel options"):
        AutoSPStrategy(sp_size=2, data_parallel="fsdp", bucket_cap_mb=1)


def test_ddp_is_the_default_and_keeps_lightnings_checkpoint_path():
    strategy = AutoSPStrategy(sp_size=2)
    assert strategy.data_parallel == "ddp"
    assert not strategy.restore_checkpoint_after_setup and strategy.lightning_restore_optimizer


def test_user_sharding_must_cover_every_parameter():
    with pytest.raises(ValueError, match=r"not sharded: \['model.wte.weight'"):
        check_user_sharding(GPTModule(), world_size=2)


def test_local_state_bytes_counts_params_grads_and_optimizer_state():
    layer = nn.Linear(4, 2)  # 10 parameters
    optimizer = torch.optim.Adam(layer.parameters())
    layer(torch.ones(1, 4)).sum().backward()
    optimizer.step()
    # Adam: exp_avg and exp_avg_sq per parameter (fp32), plus a scalar step per tensor.
    assert local_state_bytes(layer, [optimizer]) == {"params": 40, "grads": 40, "optimizer": 2 * 40 + 2 * 4}


def test_unknown_fsdp_gather_is_refused():
    with pytest.raises(ValueError, match="fsdp_gather='per_layer' is not supported; use 'per_use' or"):
        AutoSPStrategy(sp_size=2, data_parallel="fsdp", fsdp_gather="per_layer")
    with pytest.raises(ValueError, match="fsdp_gather='per_step' chooses how data_parallel='fsdp' gathers"):
        AutoSPStrategy(sp_size=2, fsdp_gather="per_step")
    assert AutoSPStrategy(sp_size=2, data_parallel="fsdp").fsdp_gather == "per_use"


def test_sharded_parameters_keep_their_names_and_ties_and_read_whole(gloo_group: str) -> None:
    """shard_parameters on a one-rank mesh: what the optimizer, checkpoints and the model each see."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied LM head
    ids = torch.tensor([[1, 2, 3]])
    expected_keys = list(model.state_dict())
    expected = model(ids)
    expected.sum().backward()
    expected_grad = model[0].weight.grad.clone()

    shard_parameters(model, init_device_mesh("cpu", (1,)))
    assert list(model.state_dict()) == expected_keys
    assert all(isinstance(p, DTensor) for p in model.parameters())
    assert model[1]._parameters["weight"] is model[0]._parameters["weight"]
    assert len(list(model.parameters())) == 2  # the tied weight once, and the head's bias
    assert type(model[1].weight) is torch.Tensor and model[1].weight.shape == (10, 4)
    assert isinstance(model[1], nn.Linear) and type(model[1]).__name__ == "Linear"

    output = model(ids)
    output.sum().backward()
    torch.testing.assert_close(output, expected)
    grad = model[0]._parameters["weight"].grad
    assert isinstance(grad, DTensor)
    torch.testing.assert_close(grad.full_tensor(), expected_grad)


# --------------------------------------------------------------------------------------------------
# meta-device init (meta_init.py): sharded on meta, then each rank's shard materialised


def test_init_module_builds_on_the_meta_device_with_fsdp() -> None:
    strategy = AutoSPStrategy(sp_size=1, data_parallel="fsdp")
    with strategy.tensor_init_context(empty_init=True):
        layer = nn.Linear(2, 2)
    assert layer.weight.is_meta


def test_a_meta_model_sharded_then_materialised_equals_a_seeded_build(gloo_group: str) -> None:
    torch.manual_seed(0)
    expected = TinyGPT()
    with torch.device("meta"):
        model = TinyGPT()
    shard_parameters(model, init_device_mesh("cpu", (1,)))
    assert all(isinstance(p, DTensor) and p.is_meta for p in model.parameters())
    torch.manual_seed(0)  # the state the build above started from
    materialize(model, torch.device("cpu"))
    for (name, param), reference in zip(model.named_parameters(), expected.parameters()):
        assert isinstance(param, DTensor) and not param.is_meta, name
        torch.testing.assert_close(param.full_tensor(), reference.detach(), rtol=0, atol=0)
    ids = torch.randint(0, VOCAB, (2, 8))
    torch.testing.assert_close(model(ids), expected(ids))  # and it still gathers where it is used


class _Scale(nn.Module):
    """A parameter and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))


class _LinearWithTable(nn.Linear):
    """reset_parameters() initialises the weights but not the buffer."""

    def __init__(self) -> None:
        super().__init__(2, 2)
        self.register_buffer("table", torch.ones(2))


def test_materialize_names_what_no_initialiser_writes() -> None:
    with torch.device("meta"):
        model = nn.Sequential(_Scale(), _LinearWithTable())
    with (
        pytest.warns(
            UserWarning, match=r"\['_Scale'\] were built on the meta device but have no reset_param"
        ),
        pytest.warns(UserWarning, match=r"\['1.table'\] were built on the meta device and left NaN"),
    ):
        materialize(model, torch.device("cpu"))
    assert torch.isfinite(model[1].weight).all()


def test_materialize_initialises_hf_models_with_their_own_init() -> None:
    # Modules without reset_parameters (RMSNorm, rotary embeddings) inside a PreTrainedModel are
    # initialised by the model's _init_weights, which also rebuilds the rotary frequency buffers.
    expected = LlamaModule()
    with torch.device("meta"):
        model = LlamaModule()
    materialize(model, torch.device("cpu"))
    for (name, buffer), reference in zip(model.named_buffers(), expected.buffers()):
        torch.testing.assert_close(buffer, reference, rtol=0, atol=0, msg=name)
    for name, param in model.named_parameters():
        if "norm" in name:
            assert torch.equal(param, torch.ones_like(param)), name
        else:  # normal(0, initializer_range=0.02), not nn.Linear's default
            assert 0.015 < float(param.detach().std()) < 0.025, name
