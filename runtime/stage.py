"""This rank's stage: the plan's layer ranges turned into one ``StageModule``.

Every rank builds the model from model.py (``pipeplan.capture.materialise.build_model``):
a model small enough is built whole under the run's seed, as always (so every stage,
and every copy of a tied parameter, starts from identical weights); a larger one (or
any, with ``--build meta``) is built on the meta device, and each rank materialises
only the modules its own chunks hold, each initialised under a seed derived from its
qualified name, so the weights do not depend on the plan either. The rank cuts it into the
layer graph (``pipeplan.capture``: a slice for an ``nn.Sequential``, a ``torch.fx`` split,
or a ``torch.export`` capture for a model fx cannot trace, taken at the micro-batch size
since export specialises shapes), checks the graph's fingerprint against the plan,
splits it by the plan's stages and keeps its own stage's module; every value that
crosses a cut, skips over several stages included, becomes a message (``value_ids``).
A stage that reads a model input (token ids, an attention mask) draws it from the data
itself (``pipeplan.runtime.data``), so model inputs are never sent.

A parameter held by several stages (a tied embedding and head) is *tied*: the stages
holding it sum its gradient each step, replica by replica (``tie_groups``), so their
copies stay identical. Tied stages must have equal replica counts.

Tensor parallelism: a stage with ``tensor_parallel`` t > 1 runs each replica on a group of t
ranks (``pipeplan.runtime.device_mesh``) whose outputs are whole and identical. A
rank at index k of its group receives a value from index ``k % t'`` of the producing
group (t' ranks) and sends to every index j of a consuming group with ``j % t == k``,
so each rank of a group exchanges exactly one copy of every value, forward and back.
``tp_splits`` names the parameters each of this rank's chunks splits.

Virtual stages (interleaved 1F1B): the plan lists v*P model stages; model stage q runs
on the ranks of pipeline position q % P, so a rank holds v *chunks* (model stages
i, i+P, ...). ``stage`` is the rank's first chunk, ``chunks`` all of them;
``rank_module`` is the one module whose parameters the rank's optimizer steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from pipeplan.capture import MODEL_OUTPUT, LayerGraph, StageModule, build_layer_graph
from pipeplan.capture.checkpointed import checkpoint_stage
from pipeplan.capture.materialise import build_model, materialise, meta_stand_ins, rebind
from pipeplan.errors import InputError
from pipeplan.modelfile import ModelFile
from pipeplan.plan import Plan

__all__ = ["PipelineSpec", "build_pipeline", "stage_of_layers", "local_names_of", "rank_names_of"]


@dataclass
class PipelineSpec:
    """What every rank knows about the pipeline, plus this rank's own stage."""

    stage: StageModule | None  # None on a rank the plan leaves idle; the first chunk
    stage_index: int  # pipeline position; -1 when idle
    replica: int
    ranks: tuple[tuple[int, ...], ...]  # ranks[q][j*t:(j+1)*t]: replica j of model stage q
    value_ids: dict[str, int]  # every value crossing a cut -> message id (same on all ranks)
    tie_groups: dict[tuple[int, ...], tuple[str, ...]]  # model stages -> tied qualified names
    fingerprint: str
    virtual_stages: int = 1  # chunks per rank
    chunks: tuple[StageModule, ...] = ()  # this rank's model stages, chunk c = stage c*P + i
    tensor_parallel: tuple[int, ...] = ()  # t of each model stage (empty: all 1)
    tp_index: int = 0  # this rank's index in its replica's tensor-parallel group
    tp_splits: tuple[dict[str, dict[str, int]], ...] = ()  # per chunk: module path -> {param: dim}
    _rank_module: nn.Module | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.chunks and self.stage is not None:
            self.chunks = (self.stage,)
        if not self.tensor_parallel:
            self.tensor_parallel = (1,) * len(self.ranks)

    @property
    def stages(self) -> int:
        """Pipeline positions P (model stages / virtual stages)."""
        return len(self.ranks) // self.virtual_stages

    @property
    def replicas(self) -> tuple[int, ...]:
        """Replicas of each pipeline position."""
        return tuple(len(r) // t for r, t in zip(self.ranks[: self.stages], self.tensor_parallel))

    def group_of(self, stage: int, unit: int) -> tuple[int, ...]:
        """The ranks running work unit ``unit`` on model stage ``stage`` (round-robin over replicas)."""
        t = self.tensor_parallel[stage]
        replica = unit % (len(self.ranks[stage]) // t)
        return self.ranks[stage][replica * t : (replica + 1) * t]

    def recv_peer(self, stage: int, unit: int) -> int:
        """The rank of ``stage`` this rank receives unit ``unit``'s values (or gradients) from."""
        group = self.group_of(stage, unit)
        return group[self.tp_index % len(group)]

    def send_peers(self, stage: int, unit: int) -> tuple[int, ...]:
        """The ranks of ``stage`` this rank sends unit ``unit``'s values (or gradients) to."""
        own = self.tensor_parallel[self.stage_index] if self.stage_index >= 0 else 1
        return tuple(r for j, r in enumerate(self.group_of(stage, unit)) if j % own == self.tp_index)

    @property
    def rank_module(self) -> nn.Module | None:
        """The module holding every parameter of this rank: the stage's, or its chunks' in a list."""
        if self.stage is None:
            return None
        if self.virtual_stages == 1:
            return self.stage.module
        if self._rank_module is None:
            self._rank_module = nn.ModuleList([chunk.module for chunk in self.chunks])
        return self._rank_module

    @property
    def qualified_names(self) -> dict[str, str]:
        """``rank_module`` parameter name -> qualified name in the user's model."""
        if self.stage is None:
            return {}
        if self.virtual_stages == 1:
            return dict(self.stage.parameter_names)
        return {
            f"{c}.{local}": qualified
            for c, chunk in enumerate(self.chunks)
            for local, qualified in chunk.parameter_names.items()
        }


def split_in_pipeline_order(graph: LayerGraph, plan: Plan) -> list[StageModule]:
    """The plan's stage modules, by model stage. The graph splits in the order the layers run
    through the stages (``Plan.pipeline_order``: a V's model stage P holds the last layers),
    and the pieces take back their model stages' ids (their producers and consumers too)."""
    order = plan.pipeline_order()
    owner = stage_of_layers(plan, len(graph))
    if order == tuple(range(len(order))):
        return graph.split(owner)
    place = {q: k for k, q in enumerate(order)}
    pieces = graph.split([place[q] for q in owner])
    out = [
        replace(
            piece,
            index=order[piece.index],
            producers={name: order[p] if p >= 0 else p for name, p in piece.producers.items()},
            consumers={name: tuple(order[c] for c in cs) for name, cs in piece.consumers.items()},
        )
        for piece in pieces
    ]
    return sorted(out, key=lambda piece: piece.index)


def stage_of_layers(plan: Plan, layers: int) -> list[int]:
    """Stage id of each of the model's ``layers`` layers; ``InputError`` on a mismatch."""
    return plan.stage_of_layers(layers)


def build_pipeline(
    model_file: ModelFile,
    plan: Plan,
    rank: int,
    seed: int,
    sample_batch_size: int,
    build: str = "auto",
    dtype: torch.dtype | None = None,
    loaded_after: bool = False,
    device: str = "cpu",
) -> PipelineSpec:
    """Build this rank's stage (module on CPU; the caller moves it to its device).

    ``sample_batch_size`` must be the micro-batch size the stages will run: a
    ``torch.export`` capture specialises shapes to the sample batch. The layers are
    rebuilt with the plan's leaf modules (else the model file's ``LEAF_MODULES``).
    ``build`` (``auto``, ``eager``, ``meta``): see the module docstring. ``dtype``: the
    compute dtype the graph is captured in (a torch.export graph bakes dtypes: HF masks, casts),
    on meta stand-ins, so the model keeps its weights as built (the masters of mixed precision).
    ``loaded_after`` (``--weights``): on meta, modules holding only parameters are not
    initialised, since the weights fill every parameter (``materialise``). ``device``: where
    the stage will run, which a torch.export graph records (``build_layer_graph``).
    """
    model, lazy, _ = build_model(model_file.build, build, seed)
    sample_inputs, _ = model_file.batch(sample_batch_size, seed=seed)
    leaf_modules = plan.leaf_modules if plan.leaf_modules is not None else model_file.leaf_modules
    opaque = plan.opaque_modules if plan.opaque_modules is not None else model_file.opaque_modules
    stand_ins = dtype is not None and any(
        p.is_floating_point() and p.dtype != dtype for p in model.parameters()
    )
    if stand_ins:
        assert dtype is not None
        sample_inputs = sample_inputs.map(lambda t: t.to(dtype) if t.is_floating_point() else t)
    with meta_stand_ins(model, dtype) if stand_ins else contextlib.nullcontext():  # type: ignore[arg-type]
        graph = build_layer_graph(model, sample_inputs, leaf_modules, opaque, device=device)
        if graph.fingerprint != plan.profile_fingerprint:
            raise InputError(
                f"{model_file.path} does not match the plan: model fingerprint {graph.fingerprint}, "
                f"plan was made for {plan.profile_fingerprint} (re-profile and re-plan this model)"
            )
        modules = split_in_pipeline_order(graph, plan)  # names by identity: the stand-ins
        modules = [  # the plan's recomputed layers and attention cores under torch.utils.checkpoint
            checkpoint_stage(graph, module, stage.recompute_layers, stage.selective_layers)
            for module, stage in zip(modules, plan.stages)
        ]
    if len(modules) != len(plan.stages):
        raise InputError(f"the plan has {len(plan.stages)} stages, the split gave {len(modules)}")
    ranks = tuple(tuple(stage.ranks) for stage in plan.stages)
    values = sorted({name for m in modules for name in m.output_names if name != MODEL_OUTPUT})
    positions = len(plan.stages) // plan.virtual_stages
    chunks: tuple[StageModule, ...] = ()
    stage_index, replica, tp_index = -1, -1, 0
    if rank in plan.used_ranks:
        stage_index, replica = plan.stage_of_rank(rank)
        tp_index = plan.stages[stage_index].ranks.index(rank) % plan.stages[stage_index].tensor_parallel
        chunks = tuple(modules[c * positions + stage_index] for c in range(plan.virtual_stages))
    if lazy:  # only this rank's chunks get storage; the rest of the model stays on meta
        if stand_ins:
            rebind([chunk.module for chunk in chunks], model)  # the meta originals, to materialise
        held = [t for chunk in chunks for t in (*chunk.module.parameters(), *chunk.module.buffers())]
        materialise(model, held, "cpu", seed, loaded_after=loaded_after)
        rebind([chunk.module for chunk in chunks], model)
    elif stand_ins:
        rebind([chunk.module for chunk in chunks], model)  # the weights as built, not the stand-ins
    splits = _tensor_parallel_splits(model_file, model, plan, modules)
    return PipelineSpec(
        stage=chunks[0] if chunks else None,
        stage_index=stage_index,
        replica=replica,
        ranks=ranks,
        value_ids={name: i for i, name in enumerate(values)},
        tie_groups=_tie_groups(modules, ranks, tuple(stage.tensor_parallel for stage in plan.stages)),
        fingerprint=graph.fingerprint,
        virtual_stages=plan.virtual_stages,
        chunks=chunks,
        tensor_parallel=tuple(stage.tensor_parallel for stage in plan.stages),
        tp_index=tp_index,
        tp_splits=tuple(splits[chunk.index] for chunk in chunks),
    )


def _tensor_parallel_splits(
    model_file: ModelFile, model: nn.Module, plan: Plan, modules: list[StageModule]
) -> list[dict[str, dict[str, int]]]:
    """Each stage's split parameters (empty where t = 1); ``InputError`` on a refusal."""
    from pipeplan.tensor_parallel.plans import resolve_splits, stage_splits

    degrees = {stage.tensor_parallel for stage in plan.stages if stage.tensor_parallel > 1}
    if not degrees:
        return [{} for _ in modules]
    splits = resolve_splits(model, model_file.tp_plan, degrees, model_file.path)
    out = []
    for stage, module in zip(plan.stages, modules):
        local = stage_splits(module.parameter_names, splits) if stage.tensor_parallel > 1 else {}
        if stage.tensor_parallel > 1 and not local:
            raise InputError(
                f"plan stage {stage.index} has tensor_parallel {stage.tensor_parallel}, but the "
                f"tensor-parallel plan splits none of its modules (layers {min(stage.layers, default=0)}.."
                f"{max(stage.layers, default=0)}); plan it with tensor_parallel 1 or name its modules in TP_PLAN"
            )
        out.append(local)
    return out


def _tie_groups(
    modules: list[StageModule], ranks: tuple[tuple[int, ...], ...], tensor_parallel: tuple[int, ...]
) -> dict[tuple[int, ...], tuple[str, ...]]:
    holders: dict[str, set[int]] = {}
    for module in modules:
        for qualified in set(module.parameter_names.values()):
            holders.setdefault(qualified, set()).add(module.index)
    groups: dict[tuple[int, ...], list[str]] = {}
    for qualified, stages in holders.items():
        if len(stages) > 1:
            groups.setdefault(tuple(sorted(stages)), []).append(qualified)
    for tied in groups:
        counts = {(len(ranks[s]), tensor_parallel[s]) for s in tied}
        if len(counts) > 1:
            raise InputError(
                f"parameter {groups[tied][0]} is tied across stages {list(tied)} with replica x "
                f"tensor-parallel ranks {[f'{len(ranks[s]) // tensor_parallel[s]}x{tensor_parallel[s]}' for s in tied]}; "
                f"tied stages need equal replica counts and degrees"
            )
    return {stages: tuple(sorted(names)) for stages, names in sorted(groups.items())}


def local_names_of(stage: StageModule, qualified: tuple[str, ...]) -> list[str]:
    """Deduplicated local parameter names of ``stage``, in the order of ``qualified``."""
    deduplicated = {name for name, _ in stage.module.named_parameters()}
    local_of = {q: local for local, q in stage.parameter_names.items() if local in deduplicated}
    return [local_of[q] for q in qualified]


def rank_names_of(spec: PipelineSpec, stages: tuple[int, ...], qualified: tuple[str, ...]) -> list[list[str]]:
    """For each qualified name, its ``rank_module`` names on this rank's chunks among ``stages``.

    One entry per chunk holding it (several when tied model stages share this rank).
    """
    positions = spec.stages
    held = [(c, chunk) for c, chunk in enumerate(spec.chunks) if c * positions + spec.stage_index in stages]
    names: list[list[str]] = [[] for _ in qualified]
    for c, chunk in held:
        for i, local in enumerate(local_names_of(chunk, qualified)):
            names[i].append(local if spec.virtual_stages == 1 else f"{c}.{local}")
    return names
