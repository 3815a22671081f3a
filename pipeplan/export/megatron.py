"""Megatron-LM: a plan as the arguments of ``pretrain_gpt.py`` for the same decoder stack.

Megatron-LM trains its own transformer, so what carries over is the shape of the plan, not
the user's modules: how many decoder layers each pipeline stage holds, where the embedding
and the loss run, and the parallel degrees. The stages become
``--pipeline-model-parallel-layout`` (Megatron Core's custom layout: ``E`` embedding, ``t``
a decoder layer, ``L`` the output layer and loss, ``|`` between stages, listed as the
plan's stages are: every device's first chunk, then every device's second under
interleaving, from which Megatron derives the virtual pipeline size). Recomputed layers
(``StagePlan.recompute_layers``) become ``--recompute-granularity full --recompute-method block
--recompute-num-layers k``: Megatron recomputes the first k decoder layers of every stage, so k
is the most blocks any stage recomputes (a block with a recomputed layer counts whole), and a
comment names the stages that then recompute more than planned. Selective recomputation
(``StagePlan.selective_layers``, the attention cores) becomes ``--recompute-granularity
selective`` (Megatron's default ``--recompute-modules core_attn``; selective takes no method
or count, and Megatron runs it on every stage: a comment names stages the plan left out).
Sequence parallelism (``StagePlan.sequence_parallel``) becomes ``--sequence-parallel``, and
replicas sharded zero1 or zero2 (``StagePlan.shard``) ``--use-distributed-optimizer``
(Megatron shards the optimizer state over the whole data-parallel group, and reduce-scatters
the gradients: ZeRO-2's traffic; a comment says where the plan shards less).

The decoder layers are the model's stack of identical blocks: the module ``P`` whose
numbered children ``P.0``, ``P.1``, ... hold the most layers and share one class
(``model.layers`` in a Hugging Face decoder, ``blocks`` in the bundled gpt). What runs
before the stack is the embedding, what runs after it the output layer.

Refused in one line, as Megatron cannot express it: schedules other than 1F1B and
interleaved 1F1B; stages replicated unevenly (Megatron's data parallelism spans whole
pipelines: d = world / (t p)) or with different tensor-parallel degrees; a cut inside a
block; the embedding off the first stage or the output layer off the last; selective and
full recomputation in one plan (Megatron's one ``--recompute-granularity``); FSDP-sharded
replicas (Megatron's distributed optimizer keeps whole parameters).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pipeplan.errors import InputError
from pipeplan.export.structure import CutError, ModelStructure, check_no_offload, positions
from pipeplan.plan import Plan

__all__ = ["MEGATRON_OPTIONS", "MEGATRON_SCHEDULES", "MegatronExport", "decoder_stack", "export_megatron"]

# pipeplan schedule -> the Megatron-LM schedule that runs it (chosen by the layout's chunks)
MEGATRON_SCHEDULES = {"1f1b-flush": "1F1B", "interleaved-1f1b": "interleaved 1F1B"}
# every Megatron-LM argument the export may write
MEGATRON_OPTIONS = (
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--pipeline-model-parallel-layout",
    "--num-layers",
    "--micro-batch-size",
    "--global-batch-size",
    "--bf16",
    "--untie-embeddings-and-output-weights",
    "--recompute-granularity",
    "--recompute-method",
    "--recompute-num-layers",
    "--sequence-parallel",
    "--use-distributed-optimizer",
)
_NUMBERED = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


@dataclass(frozen=True)
class MegatronExport:
    """Megatron-LM's arguments for the plan (``arguments()``), and what they stand for."""

    model: str
    schedule: str  # pipeplan's name
    stack: str  # the decoder stack's module name
    decoder_layers: int
    layout: tuple[str, ...]  # one entry per plan stage: "Ettt", "tttt", "ttL", ...
    tensor_parallel: int
    pipeline_parallel: int
    data_parallel: int
    microbatch_size: int
    global_batch_size: int
    bf16: bool
    tied_embeddings: bool
    # decoder blocks each stage recomputes (a block with any recomputed layer counts whole)
    recomputed_blocks: tuple[int, ...] = ()
    # stages whose attention cores are recomputed (selective), of ``stages`` in all
    selective_stages: tuple[int, ...] = ()
    stages: int = 0
    sequence_parallel: bool = False
    # per stage: its replicas' shard mode and degree (``StagePlan.shard``, ``shard_degree``)
    shards: tuple[tuple[str, int], ...] = ()

    @property
    def layout_string(self) -> str:
        return "|".join(_compress(stage) for stage in self.layout)

    def arguments(self) -> tuple[str, ...]:
        args = [
            f"--tensor-model-parallel-size {self.tensor_parallel}",
            f"--pipeline-model-parallel-size {self.pipeline_parallel}",
            f'--pipeline-model-parallel-layout "{self.layout_string}"',
            f"--num-layers {self.decoder_layers}",
            f"--micro-batch-size {self.microbatch_size}",
            f"--global-batch-size {self.global_batch_size}",
        ]
        if self.bf16:
            args.append("--bf16")
        if not self.tied_embeddings:
            args.append("--untie-embeddings-and-output-weights")
        if any(self.recomputed_blocks):
            args += [
                "--recompute-granularity full",
                "--recompute-method block",
                f"--recompute-num-layers {max(self.recomputed_blocks)}",
            ]
        if self.selective_stages:
            args.append("--recompute-granularity selective")
        if self.sequence_parallel:
            args.append("--sequence-parallel")
        if any(mode != "none" for mode, _ in self.shards):
            args.append("--use-distributed-optimizer")
        return tuple(args)

    @property
    def notes(self) -> tuple[str, ...]:
        """What Megatron's global flags change against the plan's per-stage choices."""
        out = [self.recompute_note] if self.recompute_note else []
        left = [q for q in range(self.stages) if q not in self.selective_stages]
        if self.selective_stages and left:
            out.append(
                f"Megatron recomputes attention cores on every stage; the plan leaves stage(s) "
                f"{', '.join(map(str, left))} without (slower than planned, never over its memory)"
            )
        partial = [
            f"stage {q}: {mode}/{degree}"
            for q, (mode, degree) in enumerate(self.shards)
            if degree < self.data_parallel
        ]
        if any(mode != "none" for mode, _ in self.shards) and partial:
            out.append(
                f"Megatron's distributed optimizer shards over all {self.data_parallel} data-parallel replicas of "
                f"every stage; the plan shards less ({'; '.join(partial)}): less memory than planned"
            )
        return tuple(out)

    @property
    def recompute_note(self) -> str:
        """What Megatron's one recompute count changes against the plan's per-stage choice."""
        counts = self.recomputed_blocks
        if len(set(counts)) <= 1:
            return ""
        return (
            f"Megatron's block method recomputes the first {max(counts)} decoder layers of every stage; "
            f"the plan recomputes {', '.join(map(str, counts))} per stage (the others recompute more: "
            f"slower than planned, never over its memory)"
        )

    def text(self) -> str:
        chunks = len(self.layout) // self.pipeline_parallel
        return (
            f"# pipeplan export --to megatron: {self.model}, {self.schedule} "
            f"({MEGATRON_SCHEDULES[self.schedule]}{f', {chunks} chunks per device' if chunks > 1 else ''}), "
            f"t={self.tensor_parallel} x p={self.pipeline_parallel} x d={self.data_parallel} ranks.\n"
            f"# Arguments of Megatron-LM's pretrain_gpt.py (megatron/training/arguments.py) for the same\n"
            f"# decoder stack: {self.decoder_layers} layers of {self.stack}; add the model's own sizes.\n"
            f"# Data parallelism d = world size / (t p); the global batch is d minibatches of "
            f"{self.global_batch_size // self.data_parallel}.\n"
            + "".join(f"# {note}\n" for note in self.notes)
            + " \\\n".join(self.arguments())
            + "\n"
        )


def _compress(stage: str) -> str:
    """``"Etttt"`` -> ``"Et*4"``: Megatron's repetition of a layer symbol."""
    return re.sub(r"t{2,}", lambda m: f"t*{len(m.group(0))}", stage)


def decoder_stack(structure: ModelStructure) -> tuple[str, list[int]]:
    """The decoder stack's name and each layer's block (-1: not in a block); ``CutError`` if none."""
    counts: dict[str, set[int]] = {}
    for name in structure.layer_names:
        match = _NUMBERED.match(name)
        if match and structure.is_module(f"{match.group(1)}.{match.group(2)}"):
            counts.setdefault(match.group(1), set()).add(int(match.group(2)))
    stacks = [
        prefix
        for prefix, indices in counts.items()
        if len({structure.modules[f"{prefix}.{k}"] for k in indices}) == 1
    ]
    if not stacks:
        raise CutError(
            "the model has no stack of identical numbered blocks (a ModuleList or Sequential of decoder "
            "layers): Megatron-LM places whole decoder layers, so the plan does not carry over"
        )
    stack = max(stacks, key=lambda prefix: len(counts[prefix]))
    block_of = []
    for name in structure.layer_names:
        match = _NUMBERED.match(name)
        block_of.append(int(match.group(2)) if match and match.group(1) == stack else -1)
    return stack, block_of


def export_megatron(plan: Plan, structure: ModelStructure) -> MegatronExport:
    """The plan as Megatron-LM arguments; ``InputError`` (one line) where Megatron cannot run it."""
    _check_schedule_and_degrees(plan)
    _check_memory_options(plan)
    stack, block_of = decoder_stack(structure)
    stage_of = plan.stage_of_layers(len(structure.layer_names))
    blocks = sorted({b for b in block_of if b >= 0})
    stage_of_block: dict[int, int] = {}
    for layer, block in enumerate(block_of):
        if block < 0:
            continue
        if stage_of_block.setdefault(block, stage_of[layer]) != stage_of[layer]:
            raise CutError(
                f"plan cuts inside {stack}.{block} (stages {stage_of_block[block]} and {stage_of[layer]}): "
                f"Megatron-LM places whole decoder layers; re-plan with cuts between blocks"
            )
    first_block = min(i for i, b in enumerate(block_of) if b >= 0)
    last_block = max(i for i, b in enumerate(block_of) if b >= 0)
    last_stage = len(plan.stages) - 1
    for layer, name in enumerate(structure.layer_names):
        side, stage = ("embedding", 0) if layer < first_block else ("output layer", last_stage)
        if (layer < first_block or layer > last_block) and stage_of[layer] != stage:
            raise CutError(
                f"plan stage {stage_of[layer]} runs layer {layer} ({name}), part of the {side}: "
                f"Megatron-LM runs it on stage {stage}"
            )
    layout = [
        ("E" if q == 0 else "")
        + "t" * sum(stage_of_block[b] == q for b in blocks)
        + ("L" if q == last_stage else "")
        for q in range(len(plan.stages))
    ]
    d = plan.stages[0].replicas
    return MegatronExport(
        model=plan.model,
        schedule=plan.schedule,
        stack=stack,
        decoder_layers=len(blocks),
        layout=tuple(layout),
        tensor_parallel=plan.stages[0].tensor_parallel,
        pipeline_parallel=positions(plan),
        data_parallel=d,
        microbatch_size=plan.batch_size // plan.microbatches,
        global_batch_size=plan.batch_size * d,
        bf16=plan.dtype == "bfloat16",
        tied_embeddings=_tied(structure, block_of, first_block, last_block),
        recomputed_blocks=tuple(
            len({block_of[layer] for layer in stage.recompute_layers if block_of[layer] >= 0})
            for stage in plan.stages
        ),
        selective_stages=tuple(stage.index for stage in plan.stages if stage.selective_layers),
        stages=len(plan.stages),
        sequence_parallel=any(stage.sequence_parallel for stage in plan.stages),
        shards=tuple((stage.shard, stage.shard_degree) for stage in plan.stages),
    )


def _check_memory_options(plan: Plan) -> None:
    """One line for the recomputation, sharding and offload Megatron cannot express."""
    check_no_offload(plan)
    selective = [s.index for s in plan.stages if s.selective_layers]
    full = [s.index for s in plan.stages if s.recompute_layers]
    if selective and full:
        raise InputError(
            f"plan recomputes attention cores (selective) on stage(s) {selective} and whole layers on "
            f"stage(s) {full}: Megatron-LM runs one --recompute-granularity for every stage; re-plan with "
            f"`--recompute {'selective' if len(selective) >= len(full) else 'full'}` (what most stages chose) or "
            f"`--recompute {'full' if len(selective) >= len(full) else 'selective'}`"
        )
    fsdp = [s.index for s in plan.stages if s.shard == "fsdp"]
    if fsdp:
        raise InputError(
            f"plan stage(s) {fsdp} shard their replicas fsdp: Megatron-LM's distributed optimizer shards the "
            f"optimizer state and gradients, not the parameters; re-plan with `--shard zero2` or `--shard zero1`"
        )


def _check_schedule_and_degrees(plan: Plan) -> None:
    if plan.schedule not in MEGATRON_SCHEDULES:
        raise InputError(
            f"plan schedule {plan.schedule} does not carry over: Megatron-LM runs "
            f"{' and '.join(MEGATRON_SCHEDULES)} only; re-plan with `--schedule 1f1b-flush`"
        )
    for what, values in (
        ("replicas", [s.replicas for s in plan.stages]),
        ("tensor-parallel degrees", [s.tensor_parallel for s in plan.stages]),
    ):
        if len(set(values)) > 1:
            raise InputError(
                f"plan stages have {what} {', '.join(map(str, values))}: Megatron-LM uses one for every "
                f"stage; re-plan with `--straight`" + (" and one --tensor-parallel" if what[0] == "t" else "")
            )
    p = positions(plan)
    if plan.virtual_stages > 1 and plan.microbatches % p:
        raise InputError(
            f"plan runs {plan.microbatches} micro-batches on {p} devices: Megatron-LM's interleaved "
            f"schedule needs a multiple of {p}; re-plan with `--microbatches {p * -(-plan.microbatches // p)}`"
        )


def _tied(structure: ModelStructure, block_of: list[int], first: int, last: int) -> bool:
    """Whether a parameter of the embedding is used after the stack (a tied output layer)."""
    before = set().union(*(structure.layer_parameters[i] for i in range(first)))
    after = set().union(*(structure.layer_parameters[i] for i in range(last + 1, len(block_of))))
    return bool(before & after)
