"""Shared fixtures for the single-process tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Each test compiles from a clean Dynamo cache, and leaves none behind."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def gloo_group() -> Iterator[str]:
    """The name of a one-process gloo group (world size 1), for running the autosp ops for real."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        pytest.skip("a multi-process group is already initialized in this process")
    try:
        yield dist.group.WORLD.group_name
    finally:
        if created:
            dist.destroy_process_group()
