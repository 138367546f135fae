"""torchmetrics inside compiled steps: every metric sees the whole sequence and syncs over data parallelism.

Note [Metrics over sequence shards]
    Lightning users update ``torchmetrics`` objects in their steps (``self.acc(preds, target)``) and log
    them (``self.log("acc", self.acc)``). Under ``AutoSPStrategy`` two things would go wrong: Dynamo would
    trace the metric's Python bookkeeping (a graph break inside its loops makes Dynamo run whole frames
    eagerly, without sequence parallelism), and each rank would count its own tokens while the metric's
    sync added up every rank, each sample once per sp rank.

    So for every ``Metric`` and ``MetricCollection`` of the module the strategy runs ``forward`` and
    ``update`` outside the compiled graph (a graph break at a ``torch._dynamo.disable``d call, which
    Dynamo resumes after), all-gathers from the sp group every argument that holds sequence shards (the
    compiled graph tagged its outputs with their layouts, Note [Sequence layouts]), so every rank of an sp
    group updates with the values one device would see, and syncs the metric's states over the dp group
    only (its ``process_group``). Every reduction is then exact: sums, means, concatenated states
    (AUROC), per-sequence values; ``forward``'s batch value and ``compute`` at epoch end alike.

    Cost: one all-gather per sharded argument per update (per-token predictions and targets, [B, S]
    values: small next to activations), and the metric's own work done on every sp rank. Arguments whose
    tokens were flattened with the batch ([B * S_r]) are gathered rank by rank: the single-device values
    in another order, which no sample-wise metric depends on; arguments with a sequence dim come back in
    sequence order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch import nn

from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.data import SequenceShard
from lightning_autosp.outputs import whole_sequence

_METHODS = ("forward", "update")


class MetricsOverShards:
    """Installs the whole-sequence updates and dp-group sync of Note [Metrics over sequence shards].

    Args:
        tags: the layouts of tensors leaving compiled graphs (the strategy's ``SequenceTags``).
        current_shard: this rank's sequence layout of the batch being stepped on.
        sp_group / dp_group: this rank's process groups.
    """

    def __init__(
        self,
        tags: SequenceTags,
        current_shard: Callable[[], SequenceShard | None],
        sp_group: Callable[[], dist.ProcessGroup],
        dp_group: Callable[[], dist.ProcessGroup],
    ) -> None:
        self._tags, self._current_shard, self._sp_group, self._dp_group = (
            tags,
            current_shard,
            sp_group,
            dp_group,
        )
        # Per metric: its process group and the instance attributes the wrappers replace, as they were
        # (torchmetrics sets ``update`` and ``compute`` on each instance, wrapped with its update count and
        # cache reset; popping ours would leave the bare class method, and a stale cache).
        self._installed: list[tuple[nn.Module, Any, dict[str, Any]]] = []

    def install(self, module: nn.Module) -> None:
        metric_types = _metric_types()
        if not metric_types:
            return  # torchmetrics is not installed: no metric to look after
        for metric in module.modules():
            if not isinstance(metric, metric_types) or metric is module:
                continue
            if any(metric is installed for installed, *_ in self._installed):
                continue  # wrapped already: a second wrapper would gather the gathered values
            own = {name: metric.__dict__[name] for name in _METHODS if name in metric.__dict__}
            self._installed.append((metric, getattr(metric, "process_group", None), own))
            if hasattr(metric, "process_group"):
                metric.process_group = self._dp_group()
            for name in _METHODS:
                setattr(metric, name, torch._dynamo.disable(self._whole(getattr(metric, name))))

    def uninstall(self) -> None:
        """Give every metric back its own ``forward``, ``update`` and process group, exactly as they were."""
        for metric, process_group, own in self._installed:
            for name in _METHODS:
                if name in own:
                    metric.__dict__[name] = own[name]
                else:
                    metric.__dict__.pop(name, None)
            if hasattr(metric, "process_group"):
                metric.process_group = process_group
        self._installed.clear()

    def _whole(self, method: Callable) -> Callable:
        @functools.wraps(method)
        def call(*args: Any, **kwargs: Any) -> Any:
            shard = self._current_shard()
            if shard is None:  # no sequence parallelism for this batch
                return method(*args, **kwargs)
            gather = functools.partial(self._gather, shard=shard)
            return method(
                *apply_to_collection(args, torch.Tensor, gather),
                **apply_to_collection(kwargs, torch.Tensor, gather),
            )

        return call

    def _gather(self, tensor: torch.Tensor, shard: SequenceShard) -> torch.Tensor:
        tag = self._tags.get(tensor)
        return whole_sequence(tensor, tag, shard, self._sp_group(), flat_in_rank_order=True)


def _metric_types() -> tuple[type, ...]:
    try:
        from torchmetrics import Metric, MetricCollection
    except ImportError:
        return ()
    return (Metric, MetricCollection)
