"""Helpers for single-process tests of the SP pass: capture Dynamo graphs, rewrite them per rank, and
run the rewritten graphs of all ranks in threads with an in-process stand-in for the collectives."""

from __future__ import annotations

import contextlib
import copy
import functools
import operator
import os
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import lightning_autosp.compiler.runtime.ops as ops
import lightning_autosp.compiler.runtime.ring as ring
from benchmarks.common import completed_work, registered_process_group
from lightning_autosp.compiler import symbols
from lightning_autosp.compiler.prove.layout import REPLICATE, SequenceTags, Tag
from lightning_autosp.compiler.prove.layout import shard as layout_shard
from lightning_autosp.compiler.sp_pass import SPContext, SPReport, sequence_parallel_pass
from lightning_autosp.compiler.whole_sequence import taking_shards
from lightning_autosp.data import SequenceShard, shard_batch
from tests.distributed.modules import VOCAB, GPTModule, LlamaModule, TokenizedLlamaModule

GROUP = "fake_group"
SEQ_TO_HEAD = ops.seq_to_head
SEQ_TO_HEAD_PACKED = ops.seq_to_head_packed
HEAD_TO_SEQ = ops.head_to_seq
ALL_REDUCE_SUM = ops.all_reduce_sum
SEQUENCE_WINDOW = ops.sequence_window

# kind -> (factory, q heads, head dim)
MODULES: dict[str, tuple[Callable[[], torch.nn.Module], int, int]] = {
    "gpt-causal": (lambda: GPTModule(mask="causal"), 4, 8),
    "gpt-triu": (lambda: GPTModule(mask="triu"), 4, 8),
    "gpt-window": (lambda: GPTModule(mask="window"), 4, 8),
    "llama-kv2": (lambda: LlamaModule(heads=4, kv_heads=2), 4, 8),
    "llama-kv1": (lambda: LlamaModule(heads=4, kv_heads=1), 4, 8),
    "llama-kv2-tokenized": (lambda: TokenizedLlamaModule(heads=4, kv_heads=2), 4, 8),
    "llama-kv1-tokenized": (lambda: TokenizedLlamaModule(heads=4, kv_heads=1), 4, 8),
}


@functools.cache
def module(kind: str) -> torch.nn.Module:
    """One seeded instance per kind, shared by every rank's graph (the graphs hold its parameters)."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return MODULES[kind][0]()


@functools.cache
def global_batch(batch_size: int, global_len: int, ignored_tail: int = 0) -> dict[str, torch.Tensor]:
    """Token ids (and labels when ``ignored_tail`` > 0: the last positions set to ignore_index)."""
    generator = torch.Generator().manual_seed(1000 * batch_size + global_len)
    ids = torch.randint(0, VOCAB, (batch_size, global_len), generator=generator)
    batch = {"input_ids": ids}
    if ignored_tail:
        labels = ids.clone()
        labels[:, global_len - ignored_tail :] = -100
        batch["labels"] = labels
    return batch


def training_step(kind: str) -> Callable[[dict], torch.Tensor]:
    lightning_module = module(kind)
    return lambda batch: lightning_module.training_step(batch, 0)


@dataclass
class Captured:
    gm: fx.GraphModule
    example_inputs: list[Any]


class CaptureBackend:
    """Keeps every graph Dynamo hands over; runs an untouched copy so the compiled call still works."""

    def __init__(self) -> None:
        self.graphs: list[Captured] = []

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence[Any]) -> Callable:
        runner = copy.deepcopy(gm)
        self.graphs.append(Captured(gm, list(example_inputs)))
        return runner.forward


def capture(fn: Callable, *args: Any) -> Captured:
    """The one graph Dynamo traces for ``fn(*args)`` at these (local) shapes; sequence dims the batch was
    tagged with (``shard``) are traced as symbols, as under the strategy."""
    torch._dynamo.reset()
    backend = CaptureBackend()
    torch.compile(fn, backend=backend, dynamic=False)(*args)
    assert len(backend.graphs) == 1, f"expected one graph, got {len(backend.graphs)} (a graph break?)"
    return backend.graphs[0]


def shard(
    batch: dict, world: int, rank: int, tags: SequenceTags, whole: bool = False, **kwargs: Any
) -> tuple[dict, SequenceShard]:
    """``shard_batch`` and tag the result as the strategy does (``whole``: as with trace_length="whole")."""
    sharded: list[tuple[torch.Tensor, int]] = []
    local, sequence_shard = shard_batch(
        batch,
        world=world,
        rank=rank,
        on_shard=lambda tensor, dim: sharded.append((tensor, dim)),
        whole=whole,
        **kwargs,
    )
    # the sequence may sit on a later dim (data.sequence_dim)
    tags.mark_batch(local, sharded, sequence_shard.global_len, whole=whole)
    return local, sequence_shard


def pass_on(
    fn: Callable, shard: SequenceShard, *args: Any, sharded: dict[int, int] | None = None
) -> tuple[fx.GraphModule, SPReport, list[Any]]:
    """Trace ``fn(*args)`` with the args at the indices of ``sharded`` tagged as sequence shards along the
    given dims (all others replicated), and run the SP pass: (graph, report, concrete example inputs)."""
    tags = SequenceTags()
    for index, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            dim = (sharded or {}).get(index)
            tag = Tag(layout_shard(dim), (shard.global_len,)) if dim is not None else Tag(REPLICATE)
            tags.mark(arg, tag)
    captured = capture(fn, *args)
    gm, report = sequence_parallel_pass(captured.gm, captured.example_inputs, SPContext(shard, GROUP), tags)
    return gm, report, concrete(captured.example_inputs)


def concrete(example_inputs: Sequence[Any]) -> list[Any]:
    """Dynamo's example inputs with its SymInts as the ints they were traced at (to run a graph eagerly)."""
    return [int(v.node.hint) if isinstance(v, torch.SymInt) else v for v in example_inputs]


@contextlib.contextmanager
def force_sdpa_gqa(enabled: bool) -> Iterator[None]:
    """HF repeats KV heads itself unless told to hand GQA to SDPA (``enable_gqa=True``)."""
    if not enabled:
        yield
        return
    with mock.patch.dict(os.environ, {"TRANSFORMERS_SDPA_FORCE_GQA": "1"}):
        yield


@dataclass
class Rewritten:
    gm: fx.GraphModule
    report: SPReport
    example_inputs: list[Any]
    shard: SequenceShard


@functools.cache
def rewritten_step(
    kind: str,
    global_len: int,
    world: int,
    rank: int,
    batch_size: int = 2,
    gqa: bool = False,
    ignored_tail: int = 0,
) -> Rewritten:
    """The training step of ``kind`` traced on rank ``rank``'s shard and rewritten by the SP pass.

    Cached: tests only read the graphs (fake propagation adds ``meta["val"]``, nothing else).
    """
    tags = SequenceTags()
    batch, sequence_shard = shard(global_batch(batch_size, global_len, ignored_tail), world, rank, tags)
    with force_sdpa_gqa(gqa):
        captured = capture(training_step(kind), batch)
    gm, report = sequence_parallel_pass(
        captured.gm, captured.example_inputs, SPContext(sequence_shard, GROUP), tags
    )
    return Rewritten(gm, report, concrete(captured.example_inputs), sequence_shard)


def traced(arguments: Any) -> Any:
    """Graph arguments with every size node (a SymInt the pass computes from the sequence symbols, Note [One
    graph for every length] in symbols.py) as the int it was traced at."""

    def value(arg: Any) -> Any:
        example = arg.meta.get("example_value") if isinstance(arg, fx.Node) else None
        sized = isinstance(example, (int, torch.SymInt)) and not isinstance(example, bool)
        return symbols.concrete(example) if sized else arg

    return fx.node.map_aggregate(arguments, value)


def nodes_with_target(gm: fx.GraphModule, target: object) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is target]


def packed_all_to_all(node: fx.Node) -> tuple[fx.Node, int]:
    """The one all-to-all that brought ``node`` (q, k or v) to the head layout, and which of its
    results ``node`` is (Note [One all-to-all for q, k and v])."""
    assert node.target is operator.getitem, node.format_node()
    packed, index = node.args
    assert packed.target is SEQ_TO_HEAD_PACKED, packed.format_node()
    return packed, index


def sent_value(node: fx.Node) -> fx.Node:
    """What this rank sent into the all-to-all that brought ``node`` (q, k or v) to the head layout."""
    packed, index = packed_all_to_all(node)
    return packed.args[0][index]


def fake_propagate(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> None:
    """Propagate fake tensors through the rewritten graph (writes ``meta["val"]``); raises on shape errors.

    The autosp ops have fake implementations, so no collective runs and the group name is never resolved.
    """
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example_inputs)


def fake_shape(node: fx.Node) -> tuple[int, ...]:
    return tuple(node.meta["val"].shape)


def ancestors(node: fx.Node) -> set[fx.Node]:
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current not in seen:
            seen.add(current)
            stack.extend(current.all_input_nodes)
    return seen


# --------------------------------------------------------------------------------------------------
# Running every rank's rewritten graph in one process


class ThreadedComm:
    """Stands in for ``torch.distributed`` inside ``lightning_autosp.compiler.runtime.ops`` and ``ring``: each
    rank is a thread, and a collective exchanges the ranks' tensors through shared slots between two barriers.

    The functional collectives (``torch.ops._c10d_functional``) resolve their group by name in c10d's
    registry, below Python; there ``ThreadedGroup`` is registered under the test's group names and hands
    their calls to the same exchange (``run_ranks``).
    """

    def __init__(self, world: int, timeout: float = 240.0) -> None:
        self.world = world
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.slots: list[Any] = [None] * world
        self.local = threading.local()
        self.calls: list[list[str]] = [[] for _ in range(world)]
        self.mailboxes: dict[tuple[int, int, int], queue.Queue] = {}
        self.lock = threading.Lock()

    @property
    def rank(self) -> int:
        return self.local.rank

    def _exchange(self, name: str, value: Any) -> list[Any]:
        self.calls[self.rank].append(name)
        self.slots[self.rank] = value
        self.barrier.wait()
        everyone = list(self.slots)
        self.barrier.wait()
        return everyone

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, group=None) -> None:
        # Copies: a rank reads its pieces after the exchange, when their sender may have reused its buffer.
        everyone = self._exchange("all_to_all_single", [p.clone() for p in input.split(input_split_sizes)])
        received = [everyone[source][self.rank] for source in range(self.world)]
        assert [r.shape[0] for r in received] == list(output_split_sizes), "split sizes disagree"
        output.copy_(torch.cat(received))

    def all_gather(self, tensor_list, tensor, group=None) -> None:
        everyone = self._exchange("all_gather", tensor.clone())
        for out, value in zip(tensor_list, everyone):
            assert out.shape == value.shape, "all_gather shapes disagree across ranks"
            out.copy_(value)

    # ``ops`` reads the reduce ops off the module it calls ``dist``, which is this object in a simulation.
    ReduceOp = dist.ReduceOp

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None) -> None:
        everyone = torch.stack(self._exchange("all_reduce", tensor.clone()))
        reductions = {
            dist.ReduceOp.SUM: lambda: everyone.sum(0),
            dist.ReduceOp.MAX: lambda: everyone.amax(0),
            dist.ReduceOp.MIN: lambda: everyone.amin(0),
        }
        assert op in reductions, f"reduce op {op} is not simulated"
        tensor.copy_(reductions[op]())

    def isend(self, tensor, group=None, tag=0, group_dst=None) -> _Done:
        self.calls[self.rank].append("isend")
        self._mailbox(self.rank, group_dst, tag).put(tensor.clone())
        return _Done(lambda: None)

    def irecv(self, tensor, group=None, tag=0, group_src=None) -> _Done:
        self.calls[self.rank].append("irecv")
        mailbox = self._mailbox(group_src, self.rank, tag)
        return _Done(lambda: tensor.copy_(mailbox.get(timeout=self.barrier._timeout)))

    def _mailbox(self, source: int, destination: int, tag: int) -> queue.Queue:
        with self.lock:
            return self.mailboxes.setdefault((source, destination, tag), queue.Queue())


class ThreadedGroup(dist.ProcessGroup):
    """A c10d process group whose collectives run through a ``ThreadedComm`` (the calling thread is the
    rank), so that functional collectives, eager or compiled, reach the simulated ranks."""

    def __init__(self, comm: ThreadedComm) -> None:
        super().__init__(0, comm.world)
        self.comm = comm

    def size(self) -> int:
        return self.comm.world

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        self.comm.all_to_all_single(output, input, output_split_sizes, input_split_sizes)
        return completed_work(output)

    def allreduce(self, tensors, opts=None):
        (tensor,) = tensors
        assert opts is None or opts.reduceOp == dist.ReduceOp.SUM, "only sums are simulated"
        self.comm.all_reduce(tensor)
        return completed_work(tensors)

    def _allgather_base(self, output, input, opts=None):
        self.comm.all_gather(list(output.chunk(self.comm.world)), input)
        return completed_work(output)

    def _reduce_scatter_base(self, output, input, opts=None):
        assert opts is None or opts.reduceOp == dist.ReduceOp.SUM, "only sums are simulated"
        total = input.clone()
        self.comm.all_reduce(total)
        output.copy_(total.chunk(self.comm.world)[self.comm.rank])
        return completed_work(output)

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in zip(outputs, inputs):
            self._reduce_scatter_base(output, tensor, opts)
        return completed_work(outputs)

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        for output, tensor in zip(outputs, inputs):
            self.comm.all_gather(list(output.chunk(self.comm.world)), tensor)
        return completed_work(outputs)


def registered_groups(comm: ThreadedComm, names: Sequence[str]) -> contextlib.AbstractContextManager:
    """``ThreadedGroup(comm)`` under each of ``names`` in c10d's registry of groups, for the block."""
    return registered_process_group(names, ThreadedGroup(comm))


@dataclass
class _Done:
    """A point-to-point request: ``wait()`` completes it (the receive blocks until the send arrived)."""

    finish: Callable[[], Any]

    def wait(self) -> None:
        self.finish()


SIMULATED_GROUPS = (GROUP, "sim")


def run_ranks(
    world: int, fn: Callable[[int], Any], groups: Sequence[str] = SIMULATED_GROUPS
) -> tuple[list[Any], ThreadedComm]:
    """``fn(rank)`` on ``world`` threads with the collectives talking through a ``ThreadedComm``: the
    custom ops' ``torch.distributed`` calls, and functional collectives on the groups named ``groups``."""
    comm = ThreadedComm(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        comm.local.rank = rank
        try:
            results[rank] = fn(rank)
        except BaseException as error:  # re-raised in the main thread
            errors.append(error)
            comm.barrier.abort()

    with (
        mock.patch.object(ops, "dist", comm),
        mock.patch.object(ring, "dist", comm),
        mock.patch.object(ops, "_group", lambda name: None),
        registered_groups(comm, groups),
    ):
        threads = [threading.Thread(target=worker, args=(rank,)) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    real_errors = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if real_errors or errors:
        raise (real_errors or errors)[0]
    return results, comm


# --------------------------------------------------------------------------------------------------
# A whole training step of any module, every rank simulated


@dataclass
class Simulated:
    losses: list[torch.Tensor]
    grads: dict[str, torch.Tensor]  # mean over ranks (what DDP computes)
    reports: list[SPReport]
    calls: list[list[str]]


def simulate_step(
    lightning_module: torch.nn.Module, batch: dict, world: int, whole: bool = False, **shard_kwargs: Any
) -> Simulated:
    """Rewrite ``lightning_module.training_step(batch)`` for every rank and run the ranks in threads
    (``whole``: traced at the whole sequence's length, as with trace_length="whole").

    Raises what the SP pass raises (a refusal) on the first rank.
    """
    step = lambda local: lightning_module.training_step(local, 0)  # noqa: E731
    rewritten = []
    for rank in range(world):
        tags = SequenceTags()
        local, sequence_shard = shard(batch, world, rank, tags, whole, **shard_kwargs)
        captured = capture(step, local)
        context = SPContext(sequence_shard, GROUP, shard_kwargs.get("seq_dim", 1))
        gm, report = sequence_parallel_pass(captured.gm, captured.example_inputs, context, tags)
        runner = gm if report.whole is None else taking_shards(gm, report.whole, sequence_shard)
        rewritten.append((runner, report, concrete(captured.example_inputs)))
    params = dict(lightning_module.named_parameters())

    def rank_fn(rank: int):
        gm, _, inputs = rewritten[rank]
        (loss,) = gm(*inputs)
        given = [p for p in inputs if isinstance(p, torch.nn.Parameter)]
        grads = torch.autograd.grad(loss, given, allow_unused=True)
        by_param = {id(p): g for p, g in zip(given, grads) if g is not None}
        return loss.detach(), {name: by_param.get(id(p), torch.zeros_like(p)) for name, p in params.items()}

    results, comm = run_ranks(world, rank_fn)
    mean = {name: torch.stack([grads[name] for _, grads in results]).mean(0) for name in params}
    return Simulated([loss for loss, _ in results], mean, [r for _, r, _ in rewritten], comm.calls)


def single_device(
    lightning_module: torch.nn.Module, batch: dict
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    loss = lightning_module.training_step(batch, 0)
    params = dict(lightning_module.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
    return loss.detach(), {
        n: g if g is not None else torch.zeros_like(p) for (n, p), g in zip(params.items(), grads)
    }


def simulate_compiled_step(
    lightning_module: torch.nn.Module,
    batch: dict,
    world: int,
    compiler: str = "inductor",
    whole: bool = False,
    **backend_kwargs: Any,
) -> Simulated:
    """As ``simulate_step``, but every rank's graph goes through the whole backend (SP pass, chunked loss,
    AOTAutograd with SAC, Inductor), and forward and backward run compiled, ranks as threads."""
    from lightning_autosp.compiler.backend import AutoSPBackend

    step = lambda local: lightning_module.training_step(local, 0)  # noqa: E731
    compiled = []
    # Inductor looks the groups of functional collectives up while it compiles (for its debug repro).
    with registered_groups(ThreadedComm(world), SIMULATED_GROUPS):
        for rank in range(world):
            tags = SequenceTags()
            local, sequence_shard = shard(batch, world, rank, tags, whole)
            captured = capture(step, local)
            context = SPContext(sequence_shard, GROUP)
            backend = AutoSPBackend(context, tags=tags, compiler=compiler, **backend_kwargs)
            inputs = concrete(captured.example_inputs)
            compiled.append((backend(captured.gm, inputs), inputs, backend))
    params = dict(lightning_module.named_parameters())

    def rank_fn(rank: int):
        fn, inputs, _ = compiled[rank]
        loss = fn(*inputs)[0]
        given = [p for p in inputs if isinstance(p, torch.nn.Parameter)]
        grads = torch.autograd.grad(loss, given, allow_unused=True)
        by_param = {id(p): g for p, g in zip(given, grads) if g is not None}
        return loss.detach(), {name: by_param.get(id(p), torch.zeros_like(p)) for name, p in params.items()}

    results, comm = run_ranks(world, rank_fn)
    mean = {name: torch.stack([grads[name] for _, grads in results]).mean(0) for name in params}
    reports = [report for _, _, backend in compiled for report in backend.reports]
    return Simulated([loss for loss, _ in results], mean, reports, comm.calls)
