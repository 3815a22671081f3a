"""pipeplan's own stage modules, shaped for torch.distributed.pipelining's manual ``PipelineStage``.

``LayerGraph.split`` makes one module per plan stage whose inputs and outputs are named
values (``input:k`` for model input k, else the producing node's name); a value may skip
stages, and a later stage may read a model input. torch's manual stage passes stage k's
outputs, as a tuple, to stage k + 1 alone, and feeds the model inputs to stage 0 alone. So
each stage here takes what crosses the cut before it (``carried[k - 1]``; the flat model
tensors for stage 0) and returns what crosses the cut after it (``carried[k]``): values a
later stage reads are relayed through the stages between, model inputs included, every
tensor sent contiguous. The last stage returns what the model returns, for the loss.

A parameter several stages use (a tied embedding and head) is held by each of them; on
each rank it is the model's own tensor, so copies start equal, and ``all_reduce_tied``
sums its gradient over the ranks holding it after the backward, before the optimizer
step (as Megatron does for the embedding), so they stay equal.

``pipelining_stage_modules`` is what an exported ``split.py`` calls on every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from pipeplan.capture import MODEL_OUTPUT, LayerGraph, StageModule, build_layer_graph, model_input_name
from pipeplan.errors import InputError
from pipeplan.model_inputs import ModelInputs
from pipeplan.profile import shared_parameters

__all__ = [
    "PipeliningStageModule",
    "all_reduce_tied",
    "carried_values",
    "pipelining_stage_modules",
    "split_graph",
    "stage_examples",
    "staged_loss",
    "tied_parameters",
]

# the model's inputs, in the order of the flat tensors: (keyword or position, None for a
# tensor, else the constant the model is called with)
InputLayout = tuple[tuple[str, object], ...]


class PipeliningStageModule(nn.Module):
    """One plan stage as torch's ``PipelineStage`` runs it: ``forward(*carried in)`` ->
    the tuple carried out (the model's output on the last stage)."""

    def __init__(self, stage: StageModule, inputs: tuple[str, ...], outputs: tuple[str, ...]) -> None:
        super().__init__()
        self.stage = stage.module
        self.index = stage.index
        self.input_names = inputs  # what arrives, in order
        self.output_names = outputs  # what leaves, in order (MODEL_OUTPUT alone on the last stage)
        self.reads = stage.input_names
        self.makes = stage.output_names
        # this module's parameter names ("stage.<local>") -> qualified names in the user's model
        self.parameter_names = {
            f"stage.{local}": qualified for local, qualified in stage.parameter_names.items()
        }
        # pipeline ranks -> the process group summing tied gradients (``all_reduce_tied``)
        self.tied_groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._spec: pytree.TreeSpec | None = None  # the model output's structure (last stage)
        self._constants: list[Any] = []  # its non-tensor leaves, None where a tensor goes

    def forward(self, *values: torch.Tensor) -> Any:
        env = dict(zip(self.input_names, values, strict=True))
        made = self.stage(*(env[name] for name in self.reads))
        env.update(zip(self.makes, made, strict=True))
        if self.output_names == (MODEL_OUTPUT,):
            return self._flat_output(env[MODEL_OUTPUT])
        return tuple(_sendable(env[name], values) for name in self.output_names)

    def _flat_output(self, output: Any) -> tuple[torch.Tensor, ...]:
        """The model's output as the tuple of its tensors (torch's stage returns nothing else);
        ``rebuild`` makes the model's structure again for the loss."""
        leaves, self._spec = pytree.tree_flatten(output)
        self._constants = [None if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return tuple(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))

    def rebuild(self, flat: Any) -> Any:
        """What the model returned, from the last stage's tuple of tensors."""
        if self._spec is None:
            raise RuntimeError("rebuild before the last stage's first forward")
        supply = iter(flat if isinstance(flat, (tuple, list)) else (flat,))
        leaves = [next(supply) if constant is None else constant for constant in self._constants]
        return pytree.tree_unflatten(leaves, self._spec)

    def qualified_parameters(self) -> dict[str, nn.Parameter]:
        """Qualified name in the user's model -> the parameter this stage holds."""
        local = dict(self.named_parameters(remove_duplicate=False))
        return {qualified: local[name] for name, qualified in self.parameter_names.items()}


def _sendable(value: torch.Tensor, received: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """A tensor torch's send accepts (contiguous), never the stage's own input object nor a view:
    a relayed float or a view of one crosses as a copy, so its gradient flows back through this
    stage as through any op, and torch's split backward (``stage_backward_input``, ZB-V's "I"),
    which detaches a stage's outputs in place, can (a view refuses ``detach_``)."""
    value = value.contiguous()
    if not value.is_floating_point():
        return value
    return value.clone() if value._is_view() or any(value is v for v in received) else value


def carried_values(modules: Sequence[StageModule], inputs: int) -> list[tuple[str, ...]]:
    """``carried[k]``: the values crossing the cut after stage k, sorted (model inputs
    ``input:i`` first, by position, then values by name); one entry per cut. O(values x stages)."""
    made_at = dict.fromkeys((model_input_name(i) for i in range(inputs)), -1)
    for module in modules:
        made_at.update({name: module.index for name in module.output_names if name != MODEL_OUTPUT})
    last_read: dict[str, int] = {}
    for module in modules:
        for name in module.input_names:
            last_read[name] = max(last_read.get(name, -1), module.index)
    order = {name: (0, int(name.split(":")[1]), "") for name in made_at if name.startswith("input:")}
    carried = []
    for cut in range(len(modules) - 1):
        crossing = [n for n, k in last_read.items() if made_at[n] <= cut < k]
        carried.append(tuple(sorted(crossing, key=lambda n: order.get(n, (1, 0, n)))))
    return carried


def split_graph(graph: LayerGraph, stage_of_layer: Sequence[int]) -> list[PipeliningStageModule]:
    """Every stage of ``graph`` split at ``stage_of_layer``, as ``PipelineStage`` modules."""
    modules = graph.split(stage_of_layer)
    inputs = len([n for n in graph.graph_module.graph.nodes if n.op == "placeholder"])
    carried = carried_values(modules, inputs)
    first_in = tuple(model_input_name(i) for i in range(inputs))
    out = []
    for k, module in enumerate(modules):
        arrive = first_in if k == 0 else carried[k - 1]
        leave = carried[k] if k < len(modules) - 1 else (MODEL_OUTPUT,)
        out.append(PipeliningStageModule(module, arrive, leave))
    return out


def tied_parameters(modules: Sequence[PipeliningStageModule]) -> dict[str, tuple[int, ...]]:
    """Qualified name -> the stages holding it, for each parameter held by more than one."""
    return shared_parameters((module.index, module.parameter_names.values()) for module in modules)


def staged_loss(
    modules: Sequence[PipeliningStageModule], loss_fn: Callable[[Any, Any], Any]
) -> Callable[[Any, Any], Any]:
    """``loss_fn`` on the model's output rebuilt from the last stage's tuple of tensors."""
    last = modules[-1]
    return lambda output, target: loss_fn(last.rebuild(output), target)


def _layout_inputs(layout: InputLayout, tensors: Sequence[torch.Tensor]) -> ModelInputs:
    supply = iter(tensors)
    values = [(name, next(supply) if constant is None else constant) for name, constant in layout]
    args = tuple(value for name, value in values if name.isdigit())
    return ModelInputs(args, {name: value for name, value in values if not name.isdigit()})


def pipelining_stage_modules(
    model: nn.Module,
    example_microbatch: Sequence[torch.Tensor],
    stage_of_layer: Sequence[int],
    layout: InputLayout,
    fingerprint: str,
    leaf_modules: Sequence[str] = (),
    opaque_modules: Sequence[str] = (),
    device: torch.device | str | None = None,
) -> list[PipeliningStageModule]:
    """pipeplan's split of ``model`` (the modules ``pipeplan run`` trains), every stage, for
    ``PipelineStage``; ``example_microbatch``: the flat model tensors of one micro-batch (a
    torch.export capture specialises shapes to it). ``InputError`` unless the model is the
    plan's (``fingerprint``)."""
    inputs = _layout_inputs(layout, example_microbatch)
    graph = build_layer_graph(model, inputs, leaf_modules, opaque_modules, device=device)
    if graph.fingerprint != fingerprint:
        raise InputError(
            f"the model does not match the exported plan: fingerprint {graph.fingerprint}, "
            f"exported for {fingerprint} (re-profile, re-plan and re-export this model)"
        )
    return split_graph(graph, stage_of_layer)


def stage_examples(
    modules: Sequence[PipeliningStageModule], example_microbatch: Sequence[torch.Tensor]
) -> list[tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]]:
    """Each stage's example inputs and outputs on ``example_microbatch``, for ``PipelineStage``'s
    ``input_args`` / ``output_args``: with them torch skips its shape inference, which runs each
    stage on uninitialised tensors (token ids received from an earlier stage would index an
    embedding out of range). One forward of the model with gradients on (their ``requires_grad``
    says which gradients torch sends back), the model's buffers and the RNG left as they were."""
    from pipeplan.capture.exported import preserved_buffers

    out = []
    values: tuple[torch.Tensor, ...] = tuple(example_microbatch)
    with preserved_buffers(_root(modules)), torch.random.fork_rng(devices=[]), torch.enable_grad():
        for module in modules:
            made = module(*values)
            flat = made if type(made) is tuple else (made,)
            out.append((tuple(_example(v) for v in values), tuple(_example(v) for v in flat)))
            values = tuple(_example(v) for v in flat)
    return out


def _example(value: torch.Tensor) -> torch.Tensor:
    return value.detach().requires_grad_(value.requires_grad)


class _Stages(nn.Module):
    def __init__(self, modules: Sequence[nn.Module]) -> None:
        super().__init__()
        self.stages = nn.ModuleList(modules)


def _root(modules: Sequence[nn.Module]) -> nn.Module:
    """One module holding every stage's buffers (``preserved_buffers`` restores them)."""
    return _Stages(modules)


def stage_rank(stage: int, ranks: int, v_shape: bool = False) -> int:
    """The pipeline rank torch's schedule classes run ``stage`` on: ``stage % ranks``, or in a
    V (``ScheduleZBVZeroBubble``) rank r holds stages r and 2 * ranks - 1 - r.

    >>> [stage_rank(s, 2) for s in range(4)], [stage_rank(s, 2, v_shape=True) for s in range(4)]
    ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    if v_shape and stage >= ranks:
        return 2 * ranks - 1 - stage
    return stage % ranks


def all_reduce_tied(
    modules: Sequence[nn.Module],
    tied: dict[str, tuple[int, ...]],
    ranks: int,
    group: dist.ProcessGroup | None,
    v_shape: bool = False,
) -> None:
    """Sum each tied parameter's gradient over the pipeline ranks holding it (stage s runs on
    pipeline rank ``stage_rank(s, ranks, v_shape)`` of ``group``). Every rank of ``group`` calls
    this after the schedule's step and before ``optimizer.step()``; the first call makes the
    sub-groups."""
    held: dict[str, nn.Parameter] = {}
    groups: dict[tuple[int, ...], dist.ProcessGroup] = {}
    for module in modules:
        if isinstance(module, PipeliningStageModule):
            held.update(module.qualified_parameters())
            groups = module.tied_groups  # shared by this rank's stages
    for name, stages in sorted(tied.items()):
        members = tuple(sorted({stage_rank(s, ranks, v_shape) for s in stages}))
        if len(members) < 2:
            continue  # one rank holds every copy: the same tensor, its gradient already summed
        global_ranks = tuple(dist.get_global_rank(group, r) if group else r for r in members)
        if global_ranks not in groups:
            groups[global_ranks] = dist.new_group(list(global_ranks))
        if name not in held:
            continue
        parameter = held[name]
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        dist.all_reduce(parameter.grad, group=groups[global_ranks])
