"""The zero-bubble backward split: input gradients then weight gradients equal one backward."""

from __future__ import annotations

import copy
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pipeplan.split_backward import backward_input, backward_weight

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "runtime"))

import dag  # noqa: E402
import tied  # noqa: E402


def _dag_middle(m: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(h0: torch.Tensor) -> torch.Tensor:  # residual inside, skip from the input
        h1 = torch.tanh(m.a(h0))
        h2 = torch.tanh(m.b(h1)) + h1
        h4 = torch.tanh(m.d(torch.tanh(m.c(h2))))
        return m.out(h4 + h0) + 0.1 * m.out.weight.sum()  # a weight path that skips the input

    return run


def _tied_middle(m: torch.nn.Module, tokens: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:  # the tied weight used twice in one stage
        y = torch.tanh(m.h1(x))
        y = torch.tanh(m.h2(y)) + y + m.wte(tokens)
        return m.head(m.ln(y))

    return run


@pytest.mark.parametrize("case", ["dag", "tied"])
def test_split_equals_one_backward(case: str) -> None:
    torch.manual_seed(0)
    if case == "dag":
        model = dag.build_model()
        x = torch.randn(4, 12)
        run = _dag_middle(model)
    else:
        model = tied.build_model()
        tokens = torch.randint(0, tied.VOCAB, (3, 5))
        x = torch.randn(3, 5, 8)
        run = _tied_middle(model, tokens)
    params = list(model.parameters())
    x1 = x.clone().requires_grad_(True)
    out = run(x1)
    grad_out = torch.randn_like(out)
    (dx,), work = backward_input([out], [grad_out], [x1], params)
    assert all(p.grad is None for p in params)  # nothing on the weights yet
    backward_weight(work)
    split = [None if p.grad is None else p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    x2 = x.clone().requires_grad_(True)
    run(x2).backward(grad_out)
    torch.testing.assert_close(dx, x2.grad)
    for name, got, p in zip([n for n, _ in model.named_parameters()], split, params):
        if p.grad is None:
            assert got is None, name
        else:
            torch.testing.assert_close(got, p.grad, msg=name)
    assert any(g is not None for g in split)


def test_first_stage_has_no_input_gradient() -> None:
    torch.manual_seed(0)
    model = tied.build_model()
    tokens = torch.randint(0, tied.VOCAB, (3, 5))
    loss = model(tokens).square().mean()
    grads, work = backward_input([loss], [torch.ones_like(loss)], [tokens], list(model.parameters()))
    assert grads == [None]
    backward_weight(work)
    split = [p.grad.clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
    model(tokens).square().mean().backward()
    for got, p in zip(split, model.parameters()):
        torch.testing.assert_close(got, p.grad)


def test_weight_gradients_accumulate_in_place_over_micro_batches() -> None:
    """A second micro-batch's "W" adds into the kept ``.grad``: one new gradient at a time, as
    autograd's AccumulateGrad does, not the old, the new and their sum at once."""
    from pipeplan.profiler.live_bytes import LiveBytes

    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 256, bias=False)  # a 256 KiB weight
    xs = [torch.randn(8, 256, requires_grad=True) for _ in range(2)]
    works = []
    for x in xs:
        _, work = backward_input([layer(x).sum()], [torch.ones(())], [x], [layer.weight])
        works.append(work)
    backward_weight(works[0])
    kept = layer.weight.grad
    assert kept is not None
    with LiveBytes() as live:
        backward_weight(works[1])
    assert layer.weight.grad is kept  # added into, not replaced
    assert live.peak == 256 * 256 * 4  # the second gradient only (out of place: 2x)
    torch.testing.assert_close(kept, sum(x.detach().sum(0) for x in xs).expand(256, 256))


def test_a_first_stage_weight_pass_holds_one_new_gradient_at_a_time() -> None:
    """A first stage's input needs no gradient: its "W" is the whole backward, which adds each
    weight's gradient into ``.grad`` as it is made (one 256 KiB temporary and the activation
    gradients), not all the layers' gradients at once before adding them."""
    from pipeplan.profiler.live_bytes import LiveBytes

    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(3)))
    tokens = torch.randn(8, 256)  # a first stage's input: no gradient
    works = []
    for _ in range(2):
        grads, work = backward_input(
            [model(tokens).sum()], [torch.ones(())], [tokens], list(model.parameters())
        )
        assert grads == [None] and not [g for g in work.groups if g.nodes]
        works.append(work)
    backward_weight(works[0])
    with LiveBytes() as live:
        backward_weight(works[1])
    weight = 256 * 256 * 4
    assert weight <= live.peak < 2 * weight  # was 3 weights' gradients at once
    reference = copy.deepcopy(model)
    for p in reference.parameters():
        p.grad = None
    for _ in range(2):
        reference(tokens).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad)
