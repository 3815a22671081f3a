"""``pipeplan export --to megatron``: a plan as Megatron-LM's pipeline layout and degrees.

Plans are hand-made on the bundled gpt (a stack ``blocks`` of identical blocks, a head tied
to the embedding) scaled to 4 blocks, and on a tiny Hugging Face Llama (``model.layers``,
untied head): the layout counts each stage's blocks, puts the embedding first and the
output layer last, interleaved chunks in Megatron's order; what Megatron cannot express is
refused in one line.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
from click.testing import CliRunner

from pipeplan.cli import cli
from pipeplan.errors import InputError
from pipeplan.export import model_structure
from pipeplan.export.megatron import export_megatron
from pipeplan.modelfile import bundled_model_path
from pipeplan.plan import Plan

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES / "runtime"))

from plans import make_plan  # noqa: E402

GPT = str(bundled_model_path("gpt"))
LLAMA = str(FIXTURES / "models" / "hf_family.py")
EMBED, BLOCK = 1, 7  # the gpt's layers: wte, 7 per block, ln_f (with the tied head)


@pytest.fixture
def four_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PIPEPLAN_GPT_LAYERS", "4")


def _blocks(first: int, last: int, embed: bool = False, head: bool = False) -> list[int]:
    """Layer indices of gpt blocks first..last (with the embedding / the final layer)."""
    layers = list(range(EMBED + first * BLOCK, EMBED + (last + 1) * BLOCK))
    return ([0] if embed else []) + layers + ([EMBED + 4 * BLOCK] if head else [])


def _export(plan: Plan, model: str = GPT) -> str:
    return export_megatron(plan, model_structure(model, plan)).text()


def test_uneven_stages_become_a_layout_with_the_embedding_first_and_the_loss_last(four_blocks: None) -> None:
    plan = make_plan(GPT, [_blocks(0, 0, embed=True), _blocks(1, 3, head=True)], [1, 1], microbatches=4)
    text = _export(plan)
    assert '--pipeline-model-parallel-layout "Et|t*3L"' in text
    assert "--pipeline-model-parallel-size 2" in text and "--num-layers 4" in text
    assert "--micro-batch-size 2" in text and "--global-batch-size 8" in text
    assert "--untie-embeddings-and-output-weights" not in text  # the gpt's head is the embedding's
    assert "decoder stack: 4 layers of blocks" in text


def test_interleaved_chunks_follow_megatrons_order_and_replicas_are_data_parallel(four_blocks: None) -> None:
    stages = [_blocks(0, 0, embed=True), _blocks(1, 1), _blocks(2, 2), _blocks(3, 3, head=True)]
    plan = make_plan(GPT, stages, [2, 2, 2, 2], "interleaved-1f1b", microbatches=4, virtual_stages=2)
    made = export_megatron(plan, model_structure(GPT, plan))
    # stage q runs on device q % 2 as its chunk q // 2: Megatron lists chunk 0 of every
    # device, then chunk 1, the plan's own stage order
    assert made.layout_string == "Et|t|t|tL" and made.pipeline_parallel == 2
    assert (made.data_parallel, made.global_batch_size, made.microbatch_size) == (2, 16, 2)
    assert "interleaved 1F1B, 2 chunks per device" in made.text()


def test_recomputed_layers_become_megatrons_block_recomputation(four_blocks: None) -> None:
    plan = make_plan(GPT, [_blocks(0, 1, embed=True), _blocks(2, 3, head=True)], [1, 1], microbatches=2)
    # stage 0 recomputes all of block 0 and one layer of block 1; stage 1 nothing
    recomputed = (*_blocks(0, 0), EMBED + BLOCK)
    plan = replace(plan, stages=(replace(plan.stages[0], recompute_layers=recomputed), plan.stages[1]))
    text = _export(plan)
    assert "--recompute-granularity full \\\n--recompute-method block \\\n--recompute-num-layers 2" in text
    assert "the plan recomputes 2, 0 per stage" in text
    assert "--recompute" not in _export(
        replace(plan, stages=tuple(replace(s, recompute_layers=()) for s in plan.stages))
    )


def test_selective_sequence_parallel_and_sharded_replicas_become_megatrons_flags(four_blocks: None) -> None:
    """Selective recomputation on stage 0 only -> ``--recompute-granularity selective`` (no
    method or count) and a note naming stage 1; sequence parallelism on tensor-parallel
    stages -> ``--sequence-parallel``; zero1 replicas -> ``--use-distributed-optimizer``."""
    stages = [_blocks(0, 1, embed=True), _blocks(2, 3, head=True)]
    plan = make_plan(GPT, stages, [2, 2], microbatches=2, tensor_parallel=[2, 2])
    first = replace(
        plan.stages[0], selective_layers=(EMBED + 2,), sequence_parallel=True, shard="zero1", shard_degree=2
    )
    plan = replace(
        plan, stages=(first, replace(plan.stages[1], sequence_parallel=True, shard="zero1", shard_degree=2))
    )
    made = export_megatron(plan, model_structure(GPT, plan))
    args = made.arguments()
    assert "--recompute-granularity selective" in args and not any("--recompute-method" in a for a in args)
    assert "--sequence-parallel" in args and "--use-distributed-optimizer" in args
    assert made.notes == (
        "Megatron recomputes attention cores on every stage; the plan leaves stage(s) 1 without "
        "(slower than planned, never over its memory)",
    )
    plain = replace(
        plan,
        stages=tuple(
            replace(s, selective_layers=(), sequence_parallel=False, shard="none", shard_degree=1)
            for s in plan.stages
        ),
    )
    assert not {
        "--recompute-granularity selective",
        "--sequence-parallel",
        "--use-distributed-optimizer",
    } & set(export_megatron(plain, model_structure(GPT, plain)).arguments())
    mixed = replace(plan, stages=(first, replace(plan.stages[1], recompute_layers=tuple(_blocks(2, 2)))))
    with pytest.raises(
        InputError,
        match=r"^plan recomputes attention cores \(selective\) on stage\(s\) \[0\] and whole layers on stage\(s\) \[1\]: Megatron-LM runs one",
    ):
        _export(mixed)
    fsdp = replace(plan, stages=(replace(first, shard="fsdp"), plan.stages[1]))
    with pytest.raises(InputError, match=r"^plan stage\(s\) \[0\] shard their replicas fsdp: Megatron-LM"):
        _export(fsdp)


@pytest.mark.slow
def test_a_hugging_face_decoder_exports_its_layers_and_its_untied_head() -> None:
    pytest.importorskip("transformers")
    plan = make_plan(LLAMA, [list(range(6)), list(range(6, 12))], [1, 1], microbatches=2)
    text = _export(plan, LLAMA)
    assert '"Et|tL"' in text and "2 layers of model.layers" in text
    assert "--untie-embeddings-and-output-weights" in text


@pytest.mark.parametrize(
    ("stages", "replicas", "schedule", "message"),
    [
        (
            [_blocks(0, 1, embed=True), _blocks(2, 3, head=True)],
            [1, 1],
            "gpipe",
            "plan schedule gpipe does not carry over: Megatron-LM runs 1f1b-flush and interleaved-1f1b only",
        ),
        (
            [_blocks(0, 1, embed=True), _blocks(2, 3, head=True)],
            [2, 1],
            "1f1b-flush",
            "plan stages have replicas 2, 1: Megatron-LM uses one for every stage",
        ),
        (
            [list(range(12)), list(range(12, 30))],
            [1, 1],
            "1f1b-flush",
            r"plan cuts inside blocks.1 \(stages 0 and 1\): Megatron-LM places whole decoder layers",
        ),
        (
            [_blocks(0, 1, embed=True, head=True), _blocks(2, 3)],
            [1, 1],
            "1f1b-flush",
            r"plan stage 0 runs layer 29 \(ln_f\), part of the output layer: Megatron-LM runs it on stage 1",
        ),
    ],
)
def test_what_megatron_cannot_express_is_one_line(
    four_blocks: None, stages: list[list[int]], replicas: list[int], schedule: str, message: str
) -> None:
    plan = make_plan(GPT, stages, replicas, schedule, microbatches=2)
    with pytest.raises(InputError, match=message):
        _export(plan)


def test_a_model_without_a_block_stack_is_refused(tmp_path: Path) -> None:
    plan = make_plan(str(FIXTURES / "runtime" / "mlp.py"), [[0, 1, 2], [3, 4, 5]], [1, 1], microbatches=2)
    with pytest.raises(InputError, match="no stack of identical numbered blocks"):
        _export(plan, str(FIXTURES / "runtime" / "mlp.py"))


def test_the_cli_writes_the_arguments_atomically_and_says_the_layout(
    four_blocks: None, tmp_path: Path
) -> None:
    plan_path = tmp_path / "plan.json"
    make_plan(GPT, [_blocks(0, 1, embed=True), _blocks(2, 3, head=True)], [1, 1], microbatches=2).save(
        plan_path
    )
    out = tmp_path / "megatron.sh"
    result = CliRunner().invoke(
        cli, ["export", str(plan_path), "--to", "megatron", "--model", GPT, "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "layout Et*2|t*2L" in result.output and '"Et*2|t*2L"' in out.read_text()
    refused = CliRunner().invoke(
        cli, ["export", str(plan_path), "--to", "megatron", "--model", GPT, "--format", "toml"]
    )
    assert refused.exit_code == 2 and "--to megatron writes args, not toml" in refused.output


def _planned_interleaved(recompute: str, squeeze: bool = True) -> Plan:
    """The 4-block gpt planned interleaved (2 devices x 2 chunks, M = 4) from a hand-made
    estimated profile: each block's ln1 carries its compute (so chunks are whole blocks),
    every layer saves 1000 B, the attention core (``attn.proj``) frees 800 B under selective
    recomputation. ``squeeze``: device memory 1 B below what no recomputation needs."""
    import torch

    from pipeplan.capture import build_layer_graph
    from pipeplan.modelfile import load_model_file
    from pipeplan.planner.partition import PartitionOptions, partition
    from pipeplan.profile import DeviceInfo, LayerProfile, Profile
    from pipeplan.topology import DeviceSpec, Level, Topology

    torch.manual_seed(0)
    model_file = load_model_file(GPT)
    graph = build_layer_graph(model_file.build(), model_file.batch(2, 0)[0])
    layers = tuple(
        LayerProfile(
            node.index,
            node.name,
            node.type,
            node.inputs,
            1.0 if node.name.endswith("ln1") else 0.0,
            2.0 if node.name.endswith("ln1") else 0.0,
            200,
            100,
            1000,
            model_inputs=node.model_inputs,
            selective_saved_bytes=200 if node.name.endswith("attn.proj") else -1,
            selective_recompute_ms=0.1 if node.name.endswith("attn.proj") else -1.0,
        )  # fmt: skip
        for node in graph.layers
    )
    profile = Profile(GPT, graph.fingerprint, DeviceInfo("cpu", "x"), 8, "float32", layers, estimated="test")
    options = PartitionOptions(
        schedule="interleaved-1f1b", microbatches=4, virtual_stages=2, optimizer="sgd", straight=True
    )

    def planned(memory: int, mode: str) -> Plan:
        topology = Topology("two", DeviceSpec("d", memory), (Level("n", 2, 1e15),))
        return partition(profile, topology, replace(options, recompute=mode))

    loose = planned(10**9, "none")
    need = max(sum(s.memory_bytes for s in loose.stages[i::2]) for i in range(2))
    return planned(need - 1 if squeeze else 10**9, recompute)


def test_a_planned_interleaved_plan_exports_its_recomputation(four_blocks: None) -> None:
    """Interleaved plans choose one recomputation for the whole plan: ``auto`` where nothing
    else fits picks selective (every chunk's attention core), exported as Megatron's global
    ``--recompute-granularity selective``; ``full`` recomputes every block of every chunk:
    ``--recompute-method block --recompute-num-layers 1`` (one block per chunk)."""
    auto = _planned_interleaved("auto")
    assert auto.virtual_stages == 2 and len(auto.stages) == 4
    assert [s.selective_layers for s in auto.stages] == [(EMBED + 2 + BLOCK * b,) for b in range(4)]
    made = export_megatron(auto, model_structure(GPT, auto))
    text = made.text()
    assert made.layout_string == "Et|t|t|tL"
    assert "--recompute-granularity selective" in text and "--recompute-method" not in text
    assert "leaves stage" not in text  # every chunk recomputes its core
    full = _export(_planned_interleaved("full"))
    assert "--recompute-granularity full \\\n--recompute-method block \\\n--recompute-num-layers 1" in full
    assert "--recompute" not in _export(_planned_interleaved("auto", squeeze=False))
