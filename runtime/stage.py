"""This rank's stage: the plan's layer ranges turned into one ``StageModule``.

Every rank builds the whole model from model.py under the same seed (so every stage,
and every copy of a tied parameter, starts from identical weights), cuts it into the
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

Virtual stages (interleaved 1F1B): the plan lists v*P model stages; model stage q runs
on the ranks of pipeline position q % P, so a rank holds v *chunks* (model stages
i, i+P, ...). ``stage`` is the rank's first chunk, ``chunks`` all of them;
``rank_module`` is the one module whose parameters the rank's optimizer steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from pipeplan.errors import InputError
from pipeplan.capture import MODEL_OUTPUT, StageModule, build_layer_graph
from pipeplan.modelfile import ModelFile
from pipeplan.plan import Plan

__all__ = ["PipelineSpec", "build_pipeline", "stage_of_layers", "local_names_of", "rank_names_of"]


@dataclass
class PipelineSpec:
    """What every rank knows about the pipeline, plus this rank's own stage."""

    stage: StageModule | None  # None on a rank the plan leaves idle; the first chunk
    stage_index: int  # pipeline position; -1 when idle
    replica: int
    ranks: tuple[tuple[int, ...], ...]  # ranks[q][j]: global rank of replica j of model stage q
    value_ids: dict[str, int]  # every value crossing a cut -> message id (same on all ranks)
    tie_groups: dict[tuple[int, ...], tuple[str, ...]]  # model stages -> tied qualified names
    fingerprint: str
    virtual_stages: int = 1  # chunks per rank
    chunks: tuple[StageModule, ...] = ()  # this rank's model stages, chunk c = stage c*P + i
    _rank_module: nn.Module | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if not self.chunks and self.stage is not None:
            self.chunks = (self.stage,)

    @property
    def stages(self) -> int:
        """Pipeline positions P (model stages / virtual stages)."""
        return len(self.ranks) // self.virtual_stages

    @property
    def replicas(self) -> tuple[int, ...]:
        """Replicas of each pipeline position."""
        return tuple(len(r) for r in self.ranks[: self.stages])

    def rank_of(self, stage: int, unit: int) -> int:
        """The rank running work unit ``unit`` on model stage ``stage`` (round-robin over replicas)."""
        ranks = self.ranks[stage]
        return ranks[unit % len(ranks)]

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
        return {f"{c}.{local}": qualified for c, chunk in enumerate(self.chunks)
                for local, qualified in chunk.parameter_names.items()}


def stage_of_layers(plan: Plan, layers: int) -> list[int]:
    """Stage id of each of the model's ``layers`` layers; ``InputError`` on a mismatch."""
    owner = [-1] * layers
    for stage in plan.stages:
        for layer in stage.layers:
            if not 0 <= layer < layers:
                raise InputError(
                    f"plan stage {stage.index} names layer {layer}, the model has {layers} layers"
                )
            owner[layer] = stage.index
    missing = [i for i, s in enumerate(owner) if s < 0]
    if missing:
        raise InputError(f"plan assigns no stage to layers {missing[:5]} (model has {layers} layers)")
    return owner


def build_pipeline(model_file: ModelFile, plan: Plan, rank: int, seed: int, sample_batch_size: int) -> PipelineSpec:
    """Build this rank's stage (module on CPU; the caller moves it to its device).

    ``sample_batch_size`` must be the micro-batch size the stages will run: a
    ``torch.export`` capture specialises shapes to the sample batch. The layers are
    rebuilt with the plan's leaf modules (else the model file's ``LEAF_MODULES``).
    """
    torch.manual_seed(seed)
    model = model_file.build()
    sample_inputs, _ = model_file.batch(sample_batch_size, seed=seed)
    leaf_modules = plan.leaf_modules if plan.leaf_modules is not None else model_file.leaf_modules
    graph = build_layer_graph(model, sample_inputs, leaf_modules)
    if graph.fingerprint != plan.profile_fingerprint:
        raise InputError(
            f"{model_file.path} does not match the plan: model fingerprint {graph.fingerprint}, "
            f"plan was made for {plan.profile_fingerprint} (re-profile and re-plan this model)"
        )
    modules = graph.split(stage_of_layers(plan, len(graph)))
    if len(modules) != len(plan.stages):
        raise InputError(f"the plan has {len(plan.stages)} stages, the split gave {len(modules)}")
    ranks = tuple(tuple(stage.ranks) for stage in plan.stages)
    values = sorted({name for m in modules for name in m.output_names if name != MODEL_OUTPUT})
    positions = len(plan.stages) // plan.virtual_stages
    chunks: tuple[StageModule, ...] = ()
    stage_index, replica = -1, -1
    if rank in plan.used_ranks:
        stage_index, replica = plan.stage_of_rank(rank)
        chunks = tuple(modules[c * positions + stage_index] for c in range(plan.virtual_stages))
    return PipelineSpec(
        stage=chunks[0] if chunks else None,
        stage_index=stage_index,
        replica=replica,
        ranks=ranks,
        value_ids={name: i for i, name in enumerate(values)},
        tie_groups=_tie_groups(modules, ranks),
        fingerprint=graph.fingerprint,
        virtual_stages=plan.virtual_stages,
        chunks=chunks,
    )


def _tie_groups(modules: list[StageModule], ranks: tuple[tuple[int, ...], ...]) -> dict[tuple[int, ...], tuple[str, ...]]:
    holders: dict[str, set[int]] = {}
    for module in modules:
        for qualified in set(module.parameter_names.values()):
            holders.setdefault(qualified, set()).add(module.index)
    groups: dict[tuple[int, ...], list[str]] = {}
    for qualified, stages in holders.items():
        if len(stages) > 1:
            groups.setdefault(tuple(sorted(stages)), []).append(qualified)
    for tied in groups:
        counts = {len(ranks[s]) for s in tied}
        if len(counts) > 1:
            raise InputError(
                f"parameter {groups[tied][0]} is tied across stages {list(tied)} with replica "
                f"counts {[len(ranks[s]) for s in tied]}; tied stages need equal replica counts"
            )
    return {stages: tuple(sorted(names)) for stages, names in sorted(groups.items())}


def local_names_of(stage: StageModule, qualified: tuple[str, ...]) -> list[str]:
    """Deduplicated local parameter names of ``stage``, in the order of ``qualified``."""
    deduplicated = {name for name, _ in stage.module.named_parameters()}
    local_of = {
        q: local for local, q in stage.parameter_names.items() if local in deduplicated
    }
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
