"""The CPU peak of a profile when a block is freed on a thread the profiler does not record.

gloo's worker thread can drop the last reference to an all-to-all's buffers; the profiler records the
allocator's events of the threads it runs on, so that free has no event and the peak, which matches
allocations to frees by address, holds the block until its address is allocated again.
"""

from __future__ import annotations

import threading

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks.measure import allocator_peak, cpu_allocation_peak, unseen_frees
from benchmarks.peak_breakdown import live_at_peak

MIB = 2**20


def test_unseen_frees_are_blocks_reallocated_or_held_at_the_end_and_not_kept() -> None:
    # (time, size, address); a free has a negative size
    freed, reused, reuser, held, kept = (0, 1, 10), (1, 2, 20), (3, 2, 20), (4, 3, 30), (5, 4, 40)
    allocations = [freed, (2, -1, 10), reused, reuser, held, kept]
    assert unseen_frees(allocations, kept=[40]) == {reused, reuser, held}


def test_a_block_freed_off_the_profiled_thread_is_left_out_of_the_lower_bound() -> None:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        kept = torch.ones(MIB, dtype=torch.uint8)  # still held at the end, known to the caller
        handed = [torch.ones(4 * MIB, dtype=torch.uint8)]  # its last reference dropped by another thread
        handed_address = handed[0].untyped_storage().data_ptr()
        worker = threading.Thread(target=handed.clear)
        worker.start()
        worker.join()
        later = torch.ones(2 * MIB, dtype=torch.uint8)
        later_address = later.untyped_storage().data_ptr()
        del later
    measured = cpu_allocation_peak(prof)
    seen = cpu_allocation_peak(prof, kept=[kept.untyped_storage().data_ptr()])
    assert seen == 3 * MIB  # what this thread held at once: kept and later
    # As measured, the handed block stays until its address is allocated again: when the allocator hands it
    # to `later`, the peak is kept and handed, held at once before the worker dropped it; otherwise the
    # handed block counts to the end, beside later.
    assert measured == (5 if later_address == handed_address else 7) * MIB
    # The breakdown replays the same events: the same peak, made of the blocks it lists.
    peak, _, blocks, _, allocations = live_at_peak(prof)
    assert peak == measured == sum(block["bytes"] for block in blocks)
    assert len(allocations) >= 4  # kept, handed and later allocated, later freed


def test_allocator_peak_gives_each_steps_lower_bound_beside_its_peak() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    batch = torch.randn(512, 64)
    figures = allocator_peak(lambda: model(batch).square().mean(), model, steps=2)
    # One thread: every free has its event, so the bound leaves out only what the step still holds at its
    # end besides the gradients (the loss).
    assert len(figures["alloc_peak_seen_frees_bytes_all_steps"]) == 2
    assert 0 < figures["alloc_peak_bytes"] - figures["alloc_peak_seen_frees_bytes"] <= 1024
    assert figures["alloc_peak_bytes"] >= 3 * 512 * 256 * 4  # the hidden activations it saves
