"""FX helpers every part of the compiler shares: reading values and arguments off Dynamo nodes,
inserting nodes with fake values, and naming the user's source line of a node."""

from __future__ import annotations

import contextlib
import inspect
import logging
import re
from collections.abc import Callable

import torch
from torch import fx
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import detect_fake_mode
from torch.utils import _pytree as pytree

from lightning_autosp.compiler import symbols

log = logging.getLogger(__name__)


def example_value(node: object) -> torch.Tensor | None:
    """The fake tensor Dynamo (or a pass) recorded for ``node``, if it is a tensor."""
    value = meta_value(node)
    return value if isinstance(value, torch.Tensor) else None


def meta_value(node: object) -> object:
    """Whatever value was recorded for ``node``: a fake tensor, a SymInt, a tuple of them, None."""
    if not isinstance(node, fx.Node):
        return None
    return node.meta.get("example_value", node.meta.get("val"))


def bind(node: fx.Node, signature: inspect.Signature) -> dict[str, object]:
    """The node's call arguments by parameter name, defaults filled in."""
    args = node.args[1:] if node.op == "call_method" else node.args
    bound = signature.bind(*args, **node.kwargs)
    bound.apply_defaults()
    return dict(bound.arguments)


def op_name(node: fx.Node) -> str:
    """A short name for what ``node`` calls: a method name, a function's name, an op's name."""
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    packet = getattr(target, "_overloadpacket", None)
    if packet is not None:
        return packet.__name__
    name = getattr(target, "__name__", None)
    return name if isinstance(name, str) else str(target)


def ancestors(node: fx.Node) -> set[fx.Node]:
    """``node`` and every node it is computed from."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return seen


def call(graph: fx.Graph, target: Callable, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """Insert ``target(*args, **kwargs)`` and record its fake value, as Dynamo does for its nodes; SymInt
    arguments (sizes in the sequence symbols) become nodes computing them (``with_sizes``)."""
    node = graph.call_function(target, with_sizes(graph, args), with_sizes(graph, kwargs or {}))
    set_fake_value(node)
    return node


def with_sizes(graph: fx.Graph, arguments: object) -> object:
    """``arguments`` with every SymInt in them replaced by nodes of ``graph`` computing it."""
    return fx.node.map_aggregate(arguments, lambda value: symbols.size_node(graph, value))


def redirect_uses(node: fx.Node, replacement: fx.Node, keep: fx.Node | None = None) -> None:
    """Point every user of ``node`` at ``replacement``, except the node that wraps ``node`` itself."""
    keep = keep if keep is not None else replacement
    node.replace_all_uses_with(replacement, delete_user_cb=lambda user: user is not keep)


def set_fake_value(node: fx.Node) -> None:
    """Compute ``node``'s fake value from its inputs' (a convenience for later passes, not a must)."""
    fake_args = fx.node.map_arg(node.args, meta_value)
    fake_kwargs = fx.node.map_arg(node.kwargs, meta_value)
    inputs = flatten([fake_args, fake_kwargs])
    fake = next((v for v in inputs if isinstance(v, torch.Tensor)), None)
    mode = getattr(fake, "fake_mode", None) or _fake_mode_of(node.graph)
    if mode is None:
        return
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(v, torch.Tensor) and v.requires_grad for v in inputs
    )
    try:
        # Without autograd: recording it would call the user's saved-tensor hooks (MemoryMonitor's)
        # from inside the compiler.
        # The Python dispatcher: ops' symbolic-shape decompositions (a pad by a SymInt), as in a trace.
        with mode, torch.no_grad(), enable_python_dispatcher():
            target = node.target if node.op == "call_function" else getattr(torch.Tensor, node.target)
            value = target(*fake_args, **fake_kwargs)
    except Exception as error:
        log.debug("no fake value for %s: %s", node.name, error)
        return
    for tensor in flatten([value]):
        if needs_grad and isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
            tensor.requires_grad_()
    node.meta["example_value"] = value


def _fake_mode_of(graph: fx.Graph) -> object | None:
    """The fake mode of the graph's traced values (for nodes without tensor inputs, e.g. ``torch.ones``)."""
    for node in graph.nodes:
        mode = getattr(node.meta.get("example_value"), "fake_mode", None)
        if mode is not None:
            return mode
    return None


def flatten(value: object) -> list[object]:
    """Every leaf of nested tuples, lists, dicts and slices (an index ``x[:, :T]`` holds T in a slice)."""
    if isinstance(value, (tuple, list)):
        return [v for item in value for v in flatten(item)]
    if isinstance(value, dict):
        return [v for item in value.values() for v in flatten(item)]
    if isinstance(value, slice):
        return flatten([value.start, value.stop, value.step])
    return [value]


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n\s*(?P<code>[^\n]*)')


def source_line(node: fx.Node) -> str:
    """Where the user's code made ``node``: ``file:line in function: code``, from Dynamo's stack trace."""
    frames = list(_FRAME.finditer(node.meta.get("stack_trace") or ""))
    if not frames:
        return f"graph node {node.name}"
    frame = frames[-1]
    return f"{frame['file']}:{frame['line']} in {frame['function']}: {frame['code'].strip()}"


def index_items(index: object, rank: int) -> list:
    """A getitem index as a list of items with its ``...`` spelled out as the full slices it stands for
    over a value of ``rank`` dims (``None`` items add dims and take none)."""
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        position = items.index(Ellipsis)
        explicit = sum(1 for item in items if item is not None and item is not Ellipsis)
        items[position : position + 1] = [slice(None)] * (rank - explicit)
    return items


_IN_PLACE_OPERATORS = {"iadd", "isub", "imul", "itruediv", "ifloordiv", "imod", "ipow", "iand", "ior", "ixor"}


def writes_in_place(node: fx.Node) -> bool:
    """An in-place op of a Dynamo graph (``x.copy_(y)``, ``x.add_(y)``, ``x += y``): its effect is on its
    first argument, so it stays whether or not anything uses its result."""
    if node.op not in ("call_method", "call_function"):
        return False
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return isinstance(name, str) and (
        (name.endswith("_") and not name.startswith("_")) or name in _IN_PLACE_OPERATORS
    )


_VIEWS = {"getitem", "view", "reshape", "narrow", "select", "transpose", "permute", "unsqueeze", "squeeze"}


# torch.vmap's levels as Dynamo records them: calls whose result no node reads, which FX takes for dead code,
# but without which the batched values between them have no level to belong to.
VMAP_LEVELS = frozenset({"_vmap_increment_nesting", "_vmap_decrement_nesting"})


def _kept(node: fx.Node) -> bool:
    return (
        node.is_impure()
        or writes_in_place(node)
        or (node.op == "call_function" and op_name(node) in VMAP_LEVELS)
    )


def eliminate_dead_code(graph: fx.Graph) -> list[str]:
    """FX's dead-code elimination, which treats a method call as pure, keeping in-place writes unless
    nothing reads what they write: a tensor the graph creates whose every use is a view or such a write
    (a cache's state in training, a mask replaced by a whole one), and vmap's levels. Returns those
    tensors' names."""
    unread: list[str] = []
    while True:
        graph.eliminate_dead_code(is_impure_node=_kept)
        writes = [n for n in graph.nodes if writes_in_place(n) and not n.users and _written_unread(n)]
        if not writes:
            return unread
        for write in writes:
            unread.append(_root(write.args[0]).name)
            graph.erase_node(write)


def _root(node: fx.Node) -> fx.Node:
    while node.op in ("call_function", "call_method") and op_name(node) in _VIEWS and node.args:
        node = node.args[0]
    return node


def _written_unread(write: fx.Node) -> bool:
    """Whether the tensor ``write`` writes into is created in the graph and only viewed and written."""
    root = _root(write.args[0]) if write.args and isinstance(write.args[0], fx.Node) else None
    if root is None or root.op not in ("call_function", "call_method"):
        return False  # a graph input or a parameter: the caller sees the write
    stack, seen = [root], {root}
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if writes_in_place(user) and not user.users:
                continue
            if op_name(user) in _VIEWS and user.args[0] in seen:
                stack.append(user)
                continue
            return False
    return True


# ----------------------------------------------------------------------------------------- ATen graphs


def value_of(node: object) -> object:
    """A node's value in a graph AOTAutograd made (``meta["val"]``); anything else as it is."""
    return node.meta.get("val") if isinstance(node, fx.Node) else node


class Emitter:
    """Inserts ATen nodes into a graph AOTAutograd made, one after the other, each with its fake value
    (``meta["val"]``, as AOTAutograd records them)."""

    def __init__(self, graph: fx.Graph, after: fx.Node) -> None:
        self.graph, self.anchor = graph, after

    def call(
        self, target: object, args: tuple, kwargs: dict | None = None, like: fx.Node | None = None
    ) -> fx.Node:
        with self.graph.inserting_after(self.anchor):
            node = self.graph.call_function(target, args, kwargs or {})
        if like is not None:
            node.meta.update({k: v for k, v in like.meta.items() if k not in ("val", "tensor_meta")})
        try:
            node.meta["val"] = aten_fake_value(node)
        except Exception:
            self.graph.erase_node(node)
            raise
        self.anchor = node
        return node

    def size(self, target: object, left: object, right: object) -> object:
        """``target(left, right)`` on sizes: a number, or a node when a side is symbolic."""
        if isinstance(left, fx.Node) or isinstance(right, fx.Node):
            return self.call(target, (left, right))
        return target(left, right)


def aten_fake_value(node: fx.Node) -> object:
    """``node``'s value computed on its inputs' fake values (``meta["val"]``)."""
    args = fx.node.map_arg(node.args, value_of)
    kwargs = fx.node.map_arg(node.kwargs, value_of)
    tensors = [v for v in pytree.tree_leaves((args, kwargs)) if isinstance(v, torch.Tensor)]
    mode = detect_fake_mode(tensors) if tensors else None
    with mode or contextlib.nullcontext(), enable_python_dispatcher():
        return node.target(*args, **kwargs)


def forward_nodes(joint: fx.GraphModule) -> list[fx.Node]:
    """Nodes of a joint graph that do not depend on a tangent, i.e. the forward computation."""
    backward: set[fx.Node] = set()
    forward = []
    for node in joint.graph.nodes:
        if node.op == "placeholder":
            if "tangents" in node.name:
                backward.add(node)
            continue
        if node.op == "output":
            continue
        if any(n in backward for n in node.all_input_nodes):
            backward.add(node)
        else:
            forward.append(node)
    return forward


def calling_like(compiled: Callable, run: Callable) -> Callable:
    """``run``, a wrapper of ``compiled``, marked with its calling convention: Dynamo calls a boxed function
    (``_boxed_call``) with its inputs as one list, which the callee then owns and frees."""
    run._boxed_call = getattr(compiled, "_boxed_call", False)  # type: ignore[attr-defined]
    return run
