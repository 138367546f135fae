"""The collectives on a real one-process gloo group: the custom ops' registration (opcheck), values and
gradients of every collective, and what the functional ones trace to."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_autosp.compiler.runtime import ops as collectives
from lightning_autosp.compiler.runtime.ops import (
    _from_seq_front,
    _head_to_seq_shape,
    _seq_front,
    _seq_to_head_shape,
    is_collective,
)

LAYOUTS = {"BHSD": (1, 2), "BSHD": (2, 1)}


def _x(shape=(2, 4, 6, 3)) -> torch.Tensor:
    return torch.randn(*shape, dtype=torch.float64, requires_grad=True)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["seq_to_head", "head_to_seq"])
def test_all_to_alls_are_functional_collectives_with_their_gradient(
    gloo_group: str, name: str, layout: str
) -> None:
    """Traced, an all-to-all is ``_c10d_functional.all_to_all_single`` + ``wait_tensor`` (what Inductor
    schedules; Note [Functional collectives]), forward and backward; its gradient is exact."""
    head_dim, seq_dim = LAYOUTS[layout]
    x = _x()
    args = (head_dim, seq_dim, [x.shape[seq_dim]], 0, gloo_group)
    fn = getattr(collectives, name)
    assert torch.autograd.gradcheck(lambda t: fn(t, *args), (x,))

    def step(t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = fn(t, *args)
        return out, *torch.autograd.grad(out.square().sum(), t)

    graph = make_fx(step)(x).graph
    ops_called = [str(n.target) for n in graph.nodes if is_collective(n)]
    assert (
        ops_called
        == [
            "_c10d_functional.all_to_all_single.default",
            "_c10d_functional.wait_tensor.default",
        ]
        * 2
    )


def test_all_reduce_sum_is_a_functional_collective(gloo_group: str) -> None:
    graph = make_fx(lambda t: collectives.all_reduce_sum(t, gloo_group))(_x()).graph
    assert [str(n.target) for n in graph.nodes if is_collective(n)] == [
        "_c10d_functional.all_reduce.default",
        "_c10d_functional.wait_tensor.default",
    ]


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_round_trip_is_identity_and_gradients_flow(gloo_group: str, layout: str) -> None:
    head_dim, seq_dim = LAYOUTS[layout]
    x = _x()
    args = (head_dim, seq_dim, [x.shape[seq_dim]], 0, gloo_group)
    heads = collectives.seq_to_head(x, *args)
    assert torch.equal(heads, x)  # one rank holds every head and every token
    back = collectives.head_to_seq(heads, *args)
    assert torch.equal(back, x)
    back.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


def test_all_reduce_sum_single_rank(gloo_group: str) -> None:
    x = _x((5,))
    total = collectives.all_reduce_sum(x, gloo_group)
    assert torch.equal(total, x) and total.data_ptr() != x.data_ptr()  # out of place
    (3 * total).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


@pytest.mark.parametrize(
    ("start", "stop", "expected"),
    [
        (1, 5, [1, 2, 3, 4]),  # a slice: the label shift x[:, 1:]
        (-2, 3, [0, 0, 0, 1, 2]),  # zeros before the sequence, then its rows
        (3, 7, [3, 4, 0, 0]),  # its rows, then zeros past its end
        (-3, -1, [0, 0]),  # wholly before it
        (5, 7, [0, 0]),  # wholly past it
    ],
)
def test_a_window_of_the_sequence_on_the_only_rank(gloo_group: str, start, stop, expected) -> None:
    """Note [Windows of the sequence]: rows [start, stop) of a 5-token sequence, zeros outside it, or the
    rows of tokens joined before (positions -3 .. -1: 10, 11, 12) and after (5, 6: 20, 21)."""
    x = torch.arange(5.0).view(1, 5, 1).requires_grad_()
    window = collectives.sequence_window(x, 1, [start], [stop], [5], 0, gloo_group)
    assert window.flatten().tolist() == expected
    before, after = torch.tensor([10.0, 11.0, 12.0]).view(1, 3, 1), torch.tensor([20.0, 21.0]).view(1, 2, 1)
    joined = collectives.sequence_window(x, 1, [start], [stop], [5], 0, gloo_group, before, after)
    whole = [10, 11, 12, 0, 1, 2, 3, 4, 20, 21]  # positions -3 .. 6
    assert joined.flatten().tolist() == whole[start + 3 : stop + 3]
    (2 * joined).sum().backward()
    inside = range(max(start, 0), min(stop, 5))
    assert x.grad.flatten().tolist() == [2.0 if i in inside else 0.0 for i in range(5)]


def test_fake_shapes_for_several_ranks() -> None:
    """The fake kernels never touch the group, so shapes for any world size can be checked here."""
    with FakeTensorMode():
        x = torch.empty(2, 6, 5, 3)  # [B, H, S_1, D] on rank 1 of seq_lens [6, 5, 5]
        heads = collectives.seq_to_head(x, 1, 2, [6, 5, 5], 1, "no_group")
        assert tuple(heads.shape) == (2, 2, 16, 3)
        back = collectives.head_to_seq(heads, 1, 2, [6, 5, 5], 1, "no_group")
        assert tuple(back.shape) == (2, 6, 5, 3)
        q, k = collectives.seq_to_head_packed([x, x[:, :3]], 1, 2, [6, 5, 5], 1, "no_group")
        assert (tuple(q.shape), tuple(k.shape)) == ((2, 2, 16, 3), (2, 1, 16, 3))
        assert tuple(collectives.all_reduce_sum(torch.empty(()), "no_group").shape) == ()


def test_shape_helpers() -> None:
    assert _seq_to_head_shape([2, 4, 6, 3], 1, 2, [6, 5]) == [2, 2, 11, 3]
    assert _seq_to_head_shape([2, 6, 4, 3], 2, 1, [6, 5]) == [2, 11, 2, 3]
    assert _head_to_seq_shape([2, 2, 11, 3], 1, 2, [6, 5], 1) == [2, 4, 5, 3]
    assert _head_to_seq_shape([2, 11, 2, 3], -2, -3, [6, 5], 0) == [2, 6, 4, 3]


@settings(max_examples=30, deadline=None)
@given(
    shape=st.lists(st.integers(1, 4), min_size=3, max_size=5),
    data=st.data(),
)
def test_seq_front_round_trip(shape: list[int], data) -> None:
    ndim = len(shape)
    head_dim, seq_dim = data.draw(
        st.lists(st.integers(-ndim, ndim - 1), min_size=2, max_size=2).filter(
            lambda dims: dims[0] % ndim != dims[1] % ndim
        )
    )
    x = torch.arange(torch.Size(shape).numel()).reshape(shape)
    front = _seq_front(x, head_dim, seq_dim)
    assert front.shape[:2] == (shape[seq_dim], shape[head_dim])
    assert torch.equal(
        front[:, :, 0], x.movedim((seq_dim, head_dim), (0, 1)).reshape(*front.shape[:2], -1)[..., 0]
    )
    assert torch.equal(_from_seq_front(front, shape, head_dim, seq_dim), x)
