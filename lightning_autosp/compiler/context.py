"""What every part of the SP pass needs to know about this rank: its shard and its process groups."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_autosp.data import SequenceShard


@dataclass(frozen=True)
class SPContext:
    shard: SequenceShard
    group_name: str
    seq_dim: int = 1
    # With ring_degree > 1: the sub-groups of the sp group (Note [Ring layouts] in data.py).
    ulysses_group_name: str | None = None
    ring_group_name: str | None = None

    @property
    def comm_args(self) -> tuple[list[int], int, str]:
        return list(self.shard.seq_lens), self.shard.rank, self.group_name

    @property
    def ulysses_comm_args(self) -> tuple[list[int], int, str]:
        """The all-to-all's arguments over this rank's Ulysses group (all of sp when ring_degree is 1)."""
        if self.shard.ring_degree == 1:
            return self.comm_args
        return list(self.shard.ulysses_seq_lens), self.shard.ulysses_rank, self.ulysses_group_name

    def window_args(
        self, windows: list[tuple[int, int]], length: int
    ) -> tuple[list[int], list[int], list[int], int, str]:
        """``ops.sequence_window``'s arguments after the dim: every rank's window ``(start, stop)`` of a
        sequence-derived tensor of ``length`` positions, in rank order, and how many of them each holds."""
        starts, stops = [start for start, _ in windows], [stop for _, stop in windows]
        return starts, stops, self.shard.counts(length), self.shard.rank, self.group_name

    @property
    def group_roles(self) -> dict[str, str]:
        """Each process group's name -> its role; ranks of one sp group share the roles, not the names."""
        roles = {self.group_name: "sp", self.ulysses_group_name: "ulysses", self.ring_group_name: "ring"}
        return {name: role for name, role in roles.items() if name is not None}

    def owned(self, length: int) -> list[int]:
        """Global positions this rank owns of a sequence-derived tensor of ``length`` positions."""
        return self.shard.positions(length)

    def owned_count(self, length: int) -> int:
        return self.shard.counts(length)[self.shard.rank]  # a SymInt where the length is one
