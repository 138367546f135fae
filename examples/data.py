"""Datasets for the examples: offline, deterministic and small enough for a CPU run.

``StdlibCorpus`` is a byte-level language-modelling corpus built from the Python standard library's
own sources, so it needs no download. ``RetrievalTask`` is a synthetic long-range task whose answer
can only be found by attending across the whole sequence, i.e. across sequence-parallel shards.
"""

from __future__ import annotations

import functools
import sysconfig
from pathlib import Path
from typing import Literal

import lightning as L
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

__all__ = ["BYTE_VOCAB_SIZE", "RetrievalTask", "StdlibCorpus", "StdlibDataModule"]

BYTE_VOCAB_SIZE = 256
DEFAULT_MAX_BYTES = 4 * 2**20


@functools.lru_cache(maxsize=4)
def _stdlib_bytes(max_bytes: int) -> bytes:
    """Concatenate the stdlib's top-level ``*.py`` files in sorted order, truncated to ``max_bytes``."""
    # Top level only: on most installs ``site-packages`` lives inside the stdlib directory and would make
    # the corpus depend on whatever else is installed.
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()[: max_bytes - total]
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"".join(chunks)


class StdlibCorpus(Dataset[dict[str, torch.Tensor]]):
    """Non-overlapping byte chunks of the Python standard library's source code.

    The first ``1 - val_fraction`` of the chunks form the train split and the rest the val split, so the
    two never share text.
    """

    def __init__(
        self,
        seq_len: int,
        split: Literal["train", "val"] = "train",
        val_fraction: float = 0.05,
        max_bytes: int = DEFAULT_MAX_BYTES,
    ) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', got {split!r}")
        raw = _stdlib_bytes(max_bytes)
        n_chunks = len(raw) // seq_len
        n_val = max(1, int(n_chunks * val_fraction))
        if n_chunks - n_val < 1:
            raise ValueError(f"{len(raw)} bytes are too few for train and val chunks of {seq_len} bytes")
        # bytearray makes the buffer writable, which torch.frombuffer wants.
        tokens = torch.frombuffer(bytearray(raw[: n_chunks * seq_len]), dtype=torch.uint8)
        chunks = tokens.view(n_chunks, seq_len)
        self.chunks = chunks[: n_chunks - n_val] if split == "train" else chunks[n_chunks - n_val :]
        self.seq_len = seq_len
        self.vocab_size = BYTE_VOCAB_SIZE

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.chunks[idx].long()}


class StdlibDataModule(L.LightningDataModule):
    """Train/val dataloaders over :class:`StdlibCorpus`."""

    def __init__(
        self,
        seq_len: int = 512,
        batch_size: int = 4,
        max_bytes: int = DEFAULT_MAX_BYTES,
        num_workers: int = 0,
        val_fraction: float = 0.05,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.max_bytes = max_bytes
        self.num_workers = num_workers
        self.val_fraction = val_fraction
        self.seed = seed
        self.vocab_size = BYTE_VOCAB_SIZE

    def setup(self, stage: str | None = None) -> None:
        kwargs = {"seq_len": self.seq_len, "val_fraction": self.val_fraction, "max_bytes": self.max_bytes}
        self.train_set = StdlibCorpus(split="train", **kwargs)
        self.val_set = StdlibCorpus(split="val", **kwargs)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=shuffle,
            generator=torch.Generator().manual_seed(self.seed) if shuffle else None,
            # A fixed batch shape keeps torch.compile from recompiling for a ragged last batch.
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, shuffle=False)


class RetrievalTask(Dataset[dict[str, torch.Tensor]]):
    """Synthetic key-value retrieval over a long sequence.

    Each sample is random filler tokens with the pair ``(marker, value)`` placed at a random position in
    the first quarter. The sequence ends with ``marker, value`` again, and only the final position is
    labelled (with ``value``); all other labels are ``-100``. Labels are aligned with ``input_ids`` and
    shifted by the loss, as in Hugging Face models, so the prediction is made at the final ``marker``.
    With sequence parallelism the pair and the query land on different shards, so the task can only be
    solved if attention crosses shard boundaries.

    The marker is the last vocab id and never appears as filler or value. Samples are a pure function
    of ``(seed, idx)``.
    """

    def __init__(self, num_samples: int, seq_len: int, vocab_size: int = 64, seed: int = 0) -> None:
        if seq_len < 8:
            raise ValueError(f"seq_len must be at least 8, got {seq_len}")
        if vocab_size < 3:
            raise ValueError(f"vocab_size must be at least 3, got {vocab_size}")
        self.num_samples = num_samples
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.marker = vocab_size - 1
        self.seed = seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> dict[str, torch.Tensor]:
        if not 0 <= idx < self.num_samples:
            raise IndexError(idx)
        rng = np.random.default_rng((self.seed, idx))
        ids = rng.integers(0, self.marker, size=self.seq_len)
        value = ids[-1]
        pos = rng.integers(0, self.seq_len // 4 - 1)
        ids[pos], ids[pos + 1] = self.marker, value
        ids[-2] = self.marker
        labels = np.full(self.seq_len, -100)
        labels[-1] = value
        return {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels)}
