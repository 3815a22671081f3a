"""Verify an export by running it: every stage once, forward and backward, on one micro-batch, in-process.

A trace can pass where the run fails (a stage whose graph expects an input the schedule
never feeds it). So ``export`` runs the stages it is about to write as torch's runtime
will, in this process and without a process group: stage 0 gets the model's inputs,
stage k > 0 what torch's stage would receive (``sources``), each received tensor
detached as a fresh leaf; the last stage's output goes to the loss; then the backward
runs stage by stage from the loss, each stage's input gradients sent back to the
outputs they came from. The loss and every parameter's gradient (a tied parameter's
copies summed, as the exported code sums them) must equal one forward and backward of
the whole model. A failure is a ``StageRunError`` naming the stage and what happened,
which ``export`` reports in one line. Cost: one forward and backward of the model, twice.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from pipeplan.capture.exported import preserved_buffers
from pipeplan.errors import InputError, first_line
from pipeplan.model_inputs import ModelInputs

__all__ = ["StageRunError", "StagedModel", "check_staged", "traced_staged"]

LOSS_RTOL = 1e-4  # relative difference of the staged loss to the whole model's
GRAD_RTOL = 1e-3  # ||g_staged - g_whole|| / ||g_whole|| per parameter (float32 op order differs)

Source = tuple[int, int]  # (producing stage, index in its output tuple)


class StageRunError(InputError):
    """Running the stages as torch will failed, or they disagree with the whole model."""


@dataclass(frozen=True)
class StagedModel:
    """Stages as torch's runtime runs them: ``stages[k](*args)``; ``sources[k]`` (k > 0) says
    where each of stage k's inputs comes from; ``parameters[k]``: qualified name -> the
    parameter stage k holds."""

    stages: tuple[Callable[..., Any], ...]
    sources: tuple[tuple[Source, ...], ...]  # entry 0 is unused: stage 0 reads the model inputs
    parameters: tuple[dict[str, nn.Parameter], ...]


def _as_tuple(value: Any) -> tuple[Any, ...]:
    return value if type(value) is tuple else (value,)  # torch's _normalize_model_output_as_tuple


def _stage_output(value: Any) -> bool:
    """What torch's stage accepts as a stage's output."""
    if isinstance(value, torch.Tensor):
        return True
    return type(value) in (tuple, list) and all(isinstance(v, torch.Tensor) for v in value)


def _receive(value: Any, k: int, where: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise StageRunError(
            f"stage {k} would receive {where}, a {type(value).__name__}: torch sends tensors only"
        )
    if not value.is_contiguous():
        raise StageRunError(
            f"stage {k} would receive {where}, a tensor that is not contiguous, which torch's send "
            f'refuses ("input tensor has to be contiguous")'
        )
    return value.detach().requires_grad_(value.requires_grad)


def _forward(
    staged: StagedModel, first: tuple[torch.Tensor, ...], target: Any, loss_fn: Callable[[Any, Any], Any]
) -> tuple[torch.Tensor, list[tuple[Any, ...]], list[tuple[torch.Tensor, ...]]]:
    outputs: list[tuple[Any, ...]] = []
    received: list[tuple[torch.Tensor, ...]] = []
    last = len(staged.stages) - 1
    for k, stage in enumerate(staged.stages):
        if k == 0:
            args = first
        else:
            args = tuple(_receive(outputs[j][i], k, f"output {i} of stage {j}") for j, i in staged.sources[k])
        try:
            result = stage(*args)
        except Exception as exc:  # whatever the stage raises, the user's run would raise too
            raise StageRunError(
                f"stage {k} fails on the {len(args)} input(s) torch feeds it ({type(exc).__name__}: "
                f"{first_line(exc)[:200]})"
            ) from exc
        if not _stage_output(result):
            raise StageRunError(
                f"stage {k} returns a {type(result).__name__}; torch's stage returns a tensor or a tuple "
                f'of tensors ("Stage args must be a tensor, tuple, or list of tensors")'
            )
        outputs.append(_as_tuple(result) if k < last else (result,))
        received.append(args)
    try:
        loss = loss_fn(outputs[-1][0], target)
    except Exception as exc:
        raise StageRunError(f"the loss fails on the last stage's output ({first_line(exc)[:200]})") from exc
    return loss, outputs, received


def _backward(
    staged: StagedModel,
    loss: torch.Tensor,
    outputs: list[tuple[Any, ...]],
    received: list[tuple[torch.Tensor, ...]],
) -> dict[str, torch.Tensor]:
    """Each stage's backward as torch's ``stage_backward``: the outputs that need a gradient,
    with the gradients the next stages sent; gradients of parameters summed by qualified name."""
    grads: dict[str, torch.Tensor] = {}
    sent: list[list[torch.Tensor | None]] = [[None] * len(out) for out in outputs]
    for k in range(len(staged.stages) - 1, -1, -1):
        roots: list[torch.Tensor]
        seeds: list[torch.Tensor | None]
        if k == len(staged.stages) - 1:
            roots, seeds = [loss], [None]
        else:
            pairs = [
                (out, g)
                for out, g in zip(outputs[k], sent[k])
                if isinstance(out, torch.Tensor) and out.requires_grad
            ]
            roots = [out for out, _ in pairs]
            seeds = [g if g is not None else torch.zeros_like(out) for out, g in pairs]
        params = [(name, p) for name, p in staged.parameters[k].items() if p.requires_grad]
        inputs = [t for t in received[k] if t.requires_grad] if k else []
        wrt = [*inputs, *(p for _, p in params)]
        if not roots or not wrt:
            continue
        found = torch.autograd.grad(roots, wrt, seeds, allow_unused=True)
        by_input = dict(zip(map(id, inputs), found[: len(inputs)]))
        for (j, i), value in zip(staged.sources[k] if k else (), received[k]):
            g = by_input.get(id(value))
            before = sent[j][i]
            if g is not None:
                sent[j][i] = g if before is None else before + g
        for (name, _), g in zip(params, found[len(inputs) :]):
            if g is not None:
                grads[name] = grads[name] + g if name in grads else g
    return grads


def _compare(name: str, staged: torch.Tensor | None, whole: torch.Tensor | None) -> str | None:
    if whole is None or not bool(whole.abs().sum()):
        return None
    if staged is None:
        return f"parameter {name} gets no gradient from the stages, {float(whole.norm()):.3g} from the whole model"
    error = float((staged - whole).norm() / whole.norm())
    if error > GRAD_RTOL:
        return f"parameter {name}'s gradient differs from the whole model's by {error:.2e} (relative, limit {GRAD_RTOL:g})"
    return None


def check_staged(
    staged: StagedModel,
    model: nn.Module,
    inputs: ModelInputs,
    first: tuple[torch.Tensor, ...],
    target: Any,
    loss_fn: Callable[[Any, Any], Any],
    stage_loss_fn: Callable[[Any, Any], Any] | None = None,
) -> float:
    """Run ``staged`` (stage 0 on ``first``) and the whole model (on ``inputs``), forward and
    backward under the same seed; return the staged loss (``stage_loss_fn`` on the last
    stage's output, default ``loss_fn``). ``StageRunError`` (one line) when
    a stage fails or the loss or a gradient differs. The model's buffers are restored."""
    named = {name: p for name, p in model.named_parameters() if p.requires_grad}
    with preserved_buffers(model), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        whole_loss = loss_fn(inputs.call(model), target)
        whole = dict(zip(named, torch.autograd.grad(whole_loss, list(named.values()), allow_unused=True)))
        torch.manual_seed(0)
        loss, outputs, received = _forward(staged, first, target, stage_loss_fn or loss_fn)
        grads = _backward(staged, loss, outputs, received)
    a, b = float(loss.detach()), float(whole_loss.detach())
    if abs(a - b) > LOSS_RTOL * max(abs(b), 1e-12):
        raise StageRunError(f"the stages' loss {a:.6g} differs from the whole model's {b:.6g}")
    for name in named:
        fault = _compare(name, grads.get(name), whole[name])
        if fault:
            raise StageRunError(fault)
    return a


def traced_staged(pipe: Any, model: nn.Module, first: int) -> StagedModel:
    """torch's ``Pipe`` as its runtime runs it: stage 0 gets the ``first`` inputs ``schedule.step``
    is given; stage k > 0 receives, for each of its graph's inputs, an output of the stage
    computing it. ``StageRunError`` for what torch's stage refuses when it is built: an input
    computed outside every stage, a model input read after stage 0, a graph whose inputs are
    not the ``first`` model inputs."""
    graph: fx.Graph = pipe.split_gm.graph
    calls = [node for node in graph.nodes if node.op == "call_module"]
    index = {node.name: k for k, node in enumerate(calls)}
    qualified = {id(p): name for name, p in model.named_parameters()}
    stages, sources, parameters = [], [], []
    for k, node in enumerate(calls):
        submodule = pipe.split_gm.get_submodule(node.target)
        placeholders = [p.name for p in submodule.graph.nodes if p.op == "placeholder"]
        if k == 0 and len(placeholders) != first:
            raise StageRunError(
                f"stage 0 of torch's split takes {len(placeholders)} inputs ({', '.join(placeholders[:4])}"
                f"{', ...' if len(placeholders) > 4 else ''}), the schedule feeds it the {first} model "
                f"input(s): torch's trace computes the others outside every stage"
            )
        sources.append(() if k == 0 else tuple(_source(arg, k, index) for arg in node.args))
        stages.append(submodule)
        parameters.append(
            {qualified.get(id(p), name): p for name, p in submodule.named_parameters(remove_duplicate=False)}
        )
    return StagedModel(tuple(stages), tuple(sources), tuple(parameters))


def _source(arg: Any, k: int, index: dict[str, int]) -> Source:
    position = 0
    node = arg
    if isinstance(node, fx.Node) and node.op == "call_function" and node.target is operator.getitem:
        position = int(str(node.args[1]))
        node = node.args[0]
    if isinstance(node, fx.Node) and node.op == "placeholder":
        raise StageRunError(
            f"stage {k} of torch's split reads model input {node.name}, which the schedule feeds to stage 0 alone"
        )
    if not isinstance(node, fx.Node) or node.op != "call_module":
        what = node.op if isinstance(node, fx.Node) else type(node).__name__
        raise StageRunError(
            f"stage {k} of torch's split reads {getattr(arg, 'name', arg)}, which no stage computes "
            f"({what}): torch's stage receives only other stages' outputs"
        )
    return index[node.name], position
