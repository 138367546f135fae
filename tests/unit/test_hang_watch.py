"""The hang watch's verdict (Note [Telling a hang from a slow rank] in lightning_autosp/hang_watch.py)
from ranks' published states, and the pieces it reads them from. The watch ending real ranks that took
different collective paths, and leaving a rank that compiles late alone, is in
tests/reliability/test_reliability.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_autosp import AutoSPStrategy
from lightning_autosp.hang_watch import (
    HangWatch,
    RankState,
    Waiting,
    _state_from,
    hang_report,
    user_frame,
)

NOW = 1000.0


def state(
    rank: int, waited: float | None, *, compiling: bool = False, op: str = "gloo:all_to_all"
) -> RankState:
    waiting = None if waited is None else Waiting("sp", 7, op, NOW - waited, f"step.py:{10 + rank} in step")
    return RankState(rank=rank, time=NOW, compiling=compiling, completed=6, waiting=waiting)


def test_every_rank_waiting_past_the_timeout_is_a_hang_naming_each_ranks_collective():
    report = hang_report([state(0, 30, op="gloo:all_reduce"), state(1, 20)], 2, NOW, 10)
    assert report is not None
    assert "for at least 20 s (hang_timeout=10 s)" in report
    assert "rank 0 waits in gloo:all_reduce #7 of process group 'sp', called at step.py:10 in step" in report
    assert "rank 1 waits in gloo:all_to_all #7" in report


@pytest.mark.parametrize(
    "states",
    [
        [state(0, 30), state(1, None)],  # rank 1 computes: nothing in flight
        [state(0, 30), state(1, 30, compiling=True)],  # rank 1 compiles (a collective of its own in flight)
        [state(0, 30), state(1, 5)],  # rank 1 has waited less than the timeout: it was busy until then
        [state(0, 30)],  # rank 1 has not published yet
    ],
    ids=["computing", "compiling", "recent", "unpublished"],
)
def test_a_rank_that_is_not_stuck_means_no_hang(states):
    assert hang_report(states, 2, NOW, 10) is None


def test_states_travel_through_the_store_as_json():
    for original in (state(0, 12.5), state(3, None, compiling=True)):
        assert RankState.from_json(original.to_json()) == original


def test_the_oldest_collective_in_flight_is_read_from_the_flight_recorder_trace():
    frames = [
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 1},
        {"name": "hook", "filename": "/x/lightning_autosp/metrics.py", "line": 2},
        {"name": "training_step", "filename": "/home/me/train.py", "line": 42},
    ]

    def entry(seq: int, created: float, op: str) -> dict:
        name = ("0", "default_pg")
        return {
            "pg_id": 0,
            "process_group": name,
            "collective_seq_id": seq,
            "profiling_name": op,
            "time_created_ns": int(created * 1e9),
            "state": "scheduled",
            "frames": frames,
        }

    trace = {
        "pg_status": {"0": {"last_completed_collective": 4}},
        "entries": [
            entry(4, 1.0, "gloo:broadcast"),
            entry(5, 2.0, "gloo:all_gather"),
            entry(6, 3.0, "gloo:x"),
        ],
    }
    own = _state_from(trace, rank=1, compiling=False)
    assert own.completed == 4
    assert own.waiting == Waiting(
        "default_pg", 5, "gloo:all_gather", 2.0, "/home/me/train.py:42 in training_step"
    )


def test_a_compiled_graphs_collective_is_placed_at_the_step_that_ran_it():
    frames = [
        {"name": "call", "filename": "/tmp/torchinductor_me/ab/cab.py", "line": 90},
        {"name": "forward", "filename": "<eval_with_key>.3", "line": 5},
        {"name": "run", "filename": "/x/lightning_autosp/compiler/backend.py", "line": 218},
        {"name": "torch_dynamo_resume_in_training_step_at_75", "filename": "/home/me/train.py", "line": 75},
    ]
    assert user_frame(frames) == "/home/me/train.py:75 in training_step (inside its compiled graph)"


def test_the_watch_sees_dynamo_compile_and_publishes_it(tmp_path):
    store = dist.FileStore(str(tmp_path / "store"), 1)
    watch = HangWatch(10, store=store, rank=0, world_size=1).start()
    seen = []

    def backend(gm, inputs):
        seen.append(watch._compiling.depth > 0)
        return gm.forward

    try:
        torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
        assert seen == [True] and watch._compiling.depth == 0
        assert watch.check() is None  # one rank, nothing in flight
        published = RankState.from_json(dist.PrefixStore("autosp_hang_watch", store).get("0"))
        assert published.rank == 0 and published.waiting is None and not published.compiling
    finally:
        watch.stop()


@pytest.mark.parametrize("bad", [0, -5, float("nan"), "5m", True])
def test_a_bad_hang_timeout_is_refused_naming_the_fix(bad):
    with pytest.raises(ValueError, match=r"hang_timeout=.* positive number of seconds"):
        AutoSPStrategy(sp_size=2, hang_timeout=bad)


def test_the_hang_watch_can_be_turned_off():
    assert AutoSPStrategy(sp_size=2, hang_timeout=None).hang_timeout is None
    assert AutoSPStrategy(sp_size=2).hang_timeout == 300.0
