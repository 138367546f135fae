"""lightning-autosp: automatic sequence parallelism for PyTorch Lightning, by compiler passes."""

from lightning_autosp.callbacks import MemoryMonitor, SequenceThroughputMonitor
from lightning_autosp.compiler.prove.plan import SequenceParallelRefusal
from lightning_autosp.planning.planner import plan
from lightning_autosp.strategy import AutoSPStrategy
from lightning_autosp.tools.verify import VerifyResult, verify

__all__ = [
    "AutoSPStrategy",
    "MemoryMonitor",
    "SequenceParallelRefusal",
    "SequenceThroughputMonitor",
    "VerifyResult",
    "plan",
    "verify",
]
