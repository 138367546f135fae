"""data_parallel="fsdp": option checks and unit selection, without processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_autosp import AutoSPStrategy
from lightning_autosp.fsdp import check_user_sharding, local_state_bytes
from tests.distributed.modules import GPTModule


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
