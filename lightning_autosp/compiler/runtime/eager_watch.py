"""What a step runs outside its compiled graphs, watched for sequence data.

Note [Eager code between graphs]
    Dynamo breaks a step into several graphs where it cannot trace on, and the Python between them runs
    eagerly: the instruction that broke the graph (a branch on a tensor's value) and whole frames Dynamo
    gave up on (a wrapper it cannot resume in: transformers' output-capturing wrapper of a model whose
    dynamic-NTK rope branches on ``max(position_ids)``). The SP pass proves each graph exact; it does
    not see what runs between them. Eager code that computes on this rank's part of the sequence (a sum
    over the tokens, a size read as a Python int) computes what one device would not, silently.

    So while a sharded step runs, ``EagerWatch`` (a torch function mode) looks at every torch call made
    outside the compiled graphs, and records each call given a tensor whose tag says it holds sequence
    data: a shard, a split or the rows of this rank's tokens. A replicated tensor (the loss, an
    all-reduced largest position, a sequence gathered whole) reads the same as on one device.

    The mode does not see everything. Dynamo inlines its ``__torch_function__`` into the graphs it
    traces, and where a graph breaks *on* a torch call (``x.tolist()``, ``x.item()``) that call runs
    eagerly inside the inlined function, where the mode is off. Dynamo's graph-break log names where
    each break is, so those breaks are known (``graph_breaks_inside_the_watch``); a break elsewhere (a
    call Dynamo cannot trace, a branch on a tensor's value) runs its instruction where the mode is on.
    Of the breaks on a torch call, a step with frames Dynamo gave up on may hold only reads of a
    tensor's value as a Python number (``bool()``, ``item()``: Dynamo names the operator
    ``_local_scalar_dense``); so may the branch on a value (whose ``bool()`` the mode does not see
    either). One device reads a tensor's value only where it has one element, so the value holds no
    part of a sequence longer than one token, and the pass hands it on replicated. Nor does the mode see
    Python numbers: a graph that hands eager code a length (a size in the sequence symbol) hands it this
    rank's, and the SP pass reports those (``SPReport.length_outputs``).
    ``check_sequence_parallel_applied`` in ``steps.py`` accepts a step with frames Dynamo gave up on only
    where none of the three shows.

    The compiled graphs run with torch function modes off (``running_compiled``): their ops are not
    eager code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import lightning
import lightning_utilities
import torch
from torch._dynamo.eval_frame import set_code_exec_strategy
from torch._dynamo.guards import uninteresting_files
from torch._dynamo.types import FrameAction, FrameExecStrategy
from torch._dynamo.utils import orig_code_map
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from lightning_autosp.compiler.fx_utils import calling_like
from lightning_autosp.compiler.prove.layout import SequenceTags
from lightning_autosp.hang_watch import user_frame

_PASSING_THROUGH = {__file__, torch.overrides.__file__}  # frames between a torch call and its caller
_LAYOUT_AWARE = (
    os.path.dirname(torch._dynamo.__file__) + os.sep,
    os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep,  # lightning_autosp/
    os.path.dirname(lightning.__file__) + os.sep,  # self.log reads the batch's size (its dim 0)
    os.path.dirname(lightning_utilities.__file__) + os.sep,
)
_MOST = 3  # eager calls a refusal names
_THIS_FILE = os.path.realpath(__file__)
_GRAPH_BREAK_LOG = "torch._dynamo.symbolic_convert.__graph_breaks"  # Dynamo's graph_breaks artifact
_BREAK_SITE = re.compile(r"in user code at (?P<file>[^\n]+):\d+\nGraph Break Reason: (?P<reason>.*)", re.S)
# What a tensor holding part of the sequence says alike on every rank and on one device: its type, not
# its sizes or values. FSDP2's hooks around a unit the user sharded read its inputs' type and register
# gradient hooks on them.
_SAME_ON_EVERY_RANK = frozenset(
    {
        "device", "dtype", "layout", "ndim", "dim", "requires_grad", "is_leaf", "grad_fn", "is_cuda",
        "is_meta", "is_sparse", "is_quantized", "is_nested", "is_floating_point", "is_complex",
        "element_size", "get_device", "is_contiguous", "names", "_base", "register_hook",
    }
)  # fmt: skip


def running_compiled(compiled: Callable) -> Callable:
    """``compiled`` (a compiled graph's callable), run without torch function modes: Dynamo traced the
    modes active then into the graph, and ``EagerWatch`` is to see eager code only (it would also cost a
    Python call per op of the graph)."""

    def run(*args: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return compiled(*args)

    return calling_like(compiled, run)


class _BreaksInsideTheWatch(logging.Handler):
    """Keeps the reason of each graph break Dynamo logs as made in this file (``EagerWatch``'s function)."""

    def __init__(self) -> None:
        super().__init__()
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        match = _BREAK_SITE.search(record.getMessage())
        if match and os.path.realpath(match["file"]) == _THIS_FILE:
            self.reasons.append(match["reason"])


@contextlib.contextmanager
def graph_breaks_inside_the_watch() -> Iterator[list[str]]:
    """Dynamo's reasons for the graph breaks it makes inside ``EagerWatch.__torch_function__`` while the
    block runs: breaks on a torch call, whose eager call the watch cannot see (Note [Eager code between
    graphs]). Read from Dynamo's graph-break log, which names where each break is; the log is taken for
    the block only, and printed only where the user asked for it (``TORCH_LOGS=graph_breaks``)."""
    log = logging.getLogger(_GRAPH_BREAK_LOG)
    handler, level, propagate = _BreaksInsideTheWatch(), log.level, log.propagate
    log.addHandler(handler)
    if not log.isEnabledFor(logging.DEBUG):  # TORCH_LOGS=graph_breaks not set: taken, not printed
        log.setLevel(logging.DEBUG)
        log.propagate = False
    try:
        yield handler.reasons
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
        log.propagate = propagate


def _called_by_a_layout_aware_caller() -> bool:
    """Whether the torch call at hand comes from code that reads sequence data knowing its layout:
    Dynamo's (the bytecode it wrote for a compiled frame, and its helpers, read the sizes and strides of
    the graph's inputs before the graph runs; its guards read theirs), this package's (metrics and
    predictions gathered whole from their tags) or Lightning's (logging reads the batch size)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in _PASSING_THROUGH:
        frame = frame.f_back
    if frame is None:
        return False
    return frame.f_code.co_filename.startswith(_LAYOUT_AWARE) or frame.f_code in orig_code_map


class EagerWatch(TorchFunctionMode):
    """Records torch calls made outside compiled graphs on tensors holding sequence data (Note [Eager
    code between graphs]); ``calls``: each as ``op at file:line in function``."""

    def __init__(self, tags: SequenceTags) -> None:
        super().__init__()
        self.tags = tags
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Traced by Dynamo (is_compiling) this is a pass-through: nothing is guarded or recorded.
        if not torch.compiler.is_compiling() and len(self.calls) < _MOST:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func: Any, args: tuple, kwargs: dict) -> None:
        name = getattr(func, "__name__", str(func))
        if name == "__get__":  # an attribute: Tensor.shape.__get__
            name = getattr(getattr(func, "__self__", None), "__name__", name)
        if name in _SAME_ON_EVERY_RANK:
            return
        for value in tree_leaves((args, kwargs)):
            if not isinstance(value, torch.Tensor) or isinstance(value, torch._subclasses.FakeTensor):
                continue  # fake tensors: Dynamo's own work while it compiles
            tag = self.tags.get(value)
            if tag is not None and tag.layout.kind not in ("replicate", "global"):
                if _called_by_a_layout_aware_caller():
                    return
                stack = traceback.extract_stack()[::-1]
                frames = [{"filename": f.filename, "line": f.lineno, "name": f.name} for f in stack]
                where = user_frame(frames) or "(no line outside torch)"
                self.calls.append(f"{name} on a tensor of layout {tag.layout} at {where}")
                return


# Traced inside a compiled frame, the mode's __torch_function__ is inlined (a pass-through); called from
# eager code, it and what it calls must stay eager: were Dynamo to compile it as a frame of its own, every
# eager torch call would become a graph of one op (and the watch's own lookups graphs of their own).
set_code_exec_strategy(
    EagerWatch.__torch_function__.__code__, FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
)
# Inlined, its frame is the innermost of every op's traced stack: listed with the files Dynamo inlines as
# its own (its polyfills), a guard's location names the user's line, as without the watch.
uninteresting_files().add(__file__)
