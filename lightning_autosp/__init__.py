"""lightning-autosp: automatic sequence parallelism for PyTorch Lightning, by compiler passes."""

from lightning_autosp.callbacks import MemoryMonitor, SequenceThroughputMonitor
from lightning_autosp.planner import plan
from lightning_autosp.strategy import AutoSPStrategy

__all__ = ["AutoSPStrategy", "MemoryMonitor", "SequenceThroughputMonitor", "plan"]
