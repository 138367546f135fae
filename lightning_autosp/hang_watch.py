"""A watch over collectives that never complete: ranks that took different collective paths end in
minutes with a report of which rank waits in which collective, instead of after the process group's
timeout (30 minutes by default) with none.

Note [Telling a hang from a slow rank]
    A rank waiting in a collective for a peer that is still busy is normal: the peer may be compiling
    (Inductor can take minutes on one rank and seconds on another), or computing a long step. A hang is
    when *every* rank waits: each has a collective in flight that it issued longer ago than
    ``hang_timeout`` and none of them has completed one since, and no rank is compiling. No rank can
    then make progress, so no amount of waiting helps; a rank still computing or compiling has nothing
    in flight that old (or says it compiles), and the others keep waiting for it.

    What is in flight comes from torch's Flight Recorder (``TORCH_FR_BUFFER_SIZE``; gloo and NCCL
    alike), which records every collective a process group runs, its sequence number, its op and the
    Python stack that issued it; whether a rank compiles comes from Dynamo's compile callbacks (start and
    end of every compile, a lazily compiled backward included). Each rank publishes the two every few
    seconds in the c10d store and reads every other rank's; all ranks reach the same verdict from the
    same records, so every rank reports the same hang. A rank that is found hung prints the report, aborts
    its process groups so that a collective that can be interrupted (NCCL) raises, and, if the collective
    it waits in does not return within a grace period (gloo's cannot be interrupted), exits the process.

    Not covered: a rank that computes for longer than ``hang_timeout`` with a collective of its own in
    flight (an asynchronous gradient all-reduce, say) while the others wait in another collective looks
    the same as a hang; raise ``hang_timeout`` above the longest stretch of compute between two
    collectives, or turn the watch off (``hang_timeout=None``).
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import _dump_fr_trace
from torch._dynamo.callback import CallbackArgs, callback_handler

log = logging.getLogger(__name__)

DEFAULT_HANG_TIMEOUT_S = 300.0  # five minutes: far above a collective's own time, far below gloo's 30
FLIGHT_RECORDER_ENTRIES = "2000"  # collectives remembered per process; a step makes a few hundred
_KEY_PREFIX = "autosp_hang_watch"
_GRACE_S = 20.0  # for the main thread to leave an aborted collective before the process exits


def enable_flight_recorder() -> None:
    """Have torch record every collective (before the process group is created: it reads this then).
    A value the user set is kept."""
    if not os.environ.get("TORCH_FR_BUFFER_SIZE") and not os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE"):
        os.environ["TORCH_FR_BUFFER_SIZE"] = FLIGHT_RECORDER_ENTRIES


@dataclass(frozen=True)
class Waiting:
    """A collective this rank issued that has not completed."""

    group: str
    sequence: int
    op: str
    since: float  # time.time() when it was issued
    where: str = ""  # the innermost frame of the issuing stack outside torch and lightning


@dataclass(frozen=True)
class RankState:
    """What one rank publishes: whether it compiles, the oldest collective it waits in, how many it
    completed (any progress resets the clock)."""

    rank: int
    time: float
    compiling: bool
    completed: int
    waiting: Waiting | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> RankState:
        raw = json.loads(text)
        waiting = raw.pop("waiting")
        return cls(**raw, waiting=Waiting(**waiting) if waiting else None)


def hang_report(states: Sequence[RankState], world_size: int, now: float, timeout: float) -> str | None:
    """The report of a hang if every rank waits (Note [Telling a hang from a slow rank]), else None."""
    if len(states) < world_size:
        return None  # a rank has not published yet: it is still starting, or compiling its first step
    stuck = [
        s for s in states if not s.compiling and s.waiting is not None and now - s.waiting.since > timeout
    ]
    if len(stuck) < world_size:
        return None
    waited = min(now - s.waiting.since for s in stuck if s.waiting is not None)
    lines = [
        f"AutoSP: every rank has waited in a collective for at least {waited:.0f} s (hang_timeout="
        f"{timeout:g} s) and none can go on: the ranks called different collectives, or the same ones in "
        "a different order.",
    ]
    for state in sorted(stuck, key=lambda s: s.rank):
        w = state.waiting
        assert w is not None
        at = f", called at {w.where}" if w.where else ""
        lines.append(f"  rank {state.rank} waits in {w.op} #{w.sequence} of process group {w.group!r}{at}")
    lines.append(
        "Every rank must run the same collectives in the same order. Look for a collective that only some "
        "ranks reach: one under `if self.global_rank == ...`, a metric or `self.log(..., sync_dist=True)` in "
        "a branch that depends on the rank's data, a `trainer.strategy.barrier()` on one rank only. If a "
        "rank legitimately computes longer than this between collectives, raise "
        "AutoSPStrategy(hang_timeout=...) (None turns the watch off)."
    )
    return "\n".join(lines)


@dataclass
class _Compiling:
    """Dynamo's compile callbacks, counted (a compile may start inside another's callbacks' window)."""

    depth: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, args: CallbackArgs) -> None:
        with self.lock:
            self.depth += 1

    def end(self, args: CallbackArgs) -> None:
        with self.lock:
            self.depth = max(0, self.depth - 1)


class HangWatch:
    """A daemon thread per rank that publishes this rank's state and ends the process on a hang that
    every rank sees (Note [Telling a hang from a slow rank])."""

    def __init__(
        self,
        timeout: float,
        *,
        store: dist.Store | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        poll: float | None = None,
        on_hang: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout = timeout
        self.rank = dist.get_rank() if rank is None else rank
        self.world_size = dist.get_world_size() if world_size is None else world_size
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(_KEY_PREFIX, base)
        self.poll = poll if poll is not None else min(15.0, max(1.0, timeout / 5))
        self.on_hang = on_hang or self._end_process
        self.report: str | None = None
        self._compiling = _Compiling()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> HangWatch:
        callback_handler.register_start_callback(self._compiling.start)
        callback_handler.register_end_callback(self._compiling.end)
        self._thread = threading.Thread(target=self._run, name="autosp-hang-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the watch (it holds no state worth keeping); None, for ``watch = watch and watch.stop()``."""
        self._stop.set()
        callback_handler.remove_start_callback(self._compiling.start)
        callback_handler.remove_end_callback(self._compiling.end)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.poll + 5)
        self._thread = None

    # ---------------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                report = self.check()
            except Exception as error:  # a watch that fails must not end a healthy run
                log.debug("AutoSP hang watch: %s", error)
                continue
            if report is not None:
                self.report = report
                self.on_hang(report)
                return

    def check(self) -> str | None:
        """Publish this rank's state, read every rank's and return a hang's report, if any."""
        state = own_state(self.rank, self._compiling.depth > 0, stack_after=self.timeout / 2)
        self.store.set(str(self.rank), state.to_json())
        keys = [str(rank) for rank in range(self.world_size)]
        if not self.store.check(keys):
            return None
        states = [RankState.from_json(value) for value in self.store.multi_get(keys)]
        return hang_report(states, self.world_size, time.time(), self.timeout)

    def _end_process(self, report: str) -> None:
        print(f"[rank {self.rank}] {report}", file=sys.stderr, flush=True)
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as error:
            log.debug("AutoSP hang watch: abort failed: %s", error)
        time.sleep(_GRACE_S)  # the main thread raises out of an aborted NCCL collective meanwhile
        logging.shutdown()
        os._exit(1)


def own_state(rank: int, compiling: bool, *, stack_after: float | None = None) -> RankState:
    """This rank's state from the Flight Recorder: the oldest collective in flight, and the count of
    completed ones. Once that collective is older than ``stack_after`` seconds, where it was issued
    is read as well (the stacks cost more to dump, so only then)."""
    state = _state_from(pickle.loads(_dump_fr_trace(True, False, False)), rank, compiling)
    waiting = state.waiting
    if stack_after is not None and waiting is not None and state.time - waiting.since > stack_after:
        state = _state_from(pickle.loads(_dump_fr_trace(True, True, False)), rank, compiling)
    return state


def _state_from(trace: Mapping[str, Any], rank: int, compiling: bool) -> RankState:
    status: Mapping[str, Mapping[str, int]] = trace.get("pg_status", {})
    completed = sum(max(0, s.get("last_completed_collective", -1)) for s in status.values())
    waiting = None
    for entry in trace.get("entries", []):
        done = status.get(str(entry.get("pg_id")), {}).get("last_completed_collective", -1)
        sequence = int(entry.get("collective_seq_id", 0))
        if sequence <= done or entry.get("state") == "completed":
            continue
        candidate = Waiting(
            group=_group_name(entry),
            sequence=sequence,
            op=str(entry.get("profiling_name", "?")),
            since=float(entry.get("time_created_ns", 0)) / 1e9,
            where=user_frame(entry.get("frames") or []),
        )
        if waiting is None or candidate.since < waiting.since:
            waiting = candidate
    return RankState(rank=rank, time=time.time(), compiling=compiling, completed=completed, waiting=waiting)


def _group_name(entry: Mapping[str, Any]) -> str:
    group = entry.get("process_group")
    if isinstance(group, (tuple, list)) and len(group) == 2:
        return str(group[1] or group[0])
    return str(entry.get("pg_id"))


_LIBRARY_PARTS = tuple(
    f"{os.sep}{package}{os.sep}" for package in ("torch", "lightning", "lightning_fabric", "lightning_autosp")
)


_RESUMED = re.compile(r"^torch_dynamo_resume_in_(\w+)_at_\d+$")


def user_frame(frames: Sequence[Mapping[str, Any]]) -> str:
    """The innermost frame outside torch, Lightning, this package and generated code (``file:line in
    function``): the user's line. A compiled graph's collectives are issued from generated code, whose
    first caller outside those is the step that ran the graph."""
    generated = False
    for frame in frames:
        filename = str(frame.get("filename", ""))
        if filename.startswith("<") or f"{os.sep}torchinductor_" in filename:
            generated = True
            continue
        if not any(part in filename for part in _LIBRARY_PARTS):
            inside = " (inside its compiled graph)" if generated else ""
            function = _RESUMED.sub(r"\1", str(frame.get("name")))  # Dynamo's name for a step resumed
            return f"{filename}:{frame.get('line')} in {function}{inside}"
    return ""
