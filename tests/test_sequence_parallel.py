"""Sequence parallelism with tensor parallelism (issue 30, test (c)): DTensor's
``SequenceParallel`` on the bundled GPT's layer norms (an fx capture), DTensor's propagation on
an exported Llama's, Megatron's reduce-scatter / all-gather pair around the split matmuls; one
step on 2 gloo ranks equals unsharded training."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from test_run_torchrun import FIXTURES, assert_params_match, records, torchrun

from pipeplan.capture import build_layer_graph
from pipeplan.modelfile import load_model_file
from pipeplan.plan import Plan
from pipeplan.tensor_parallel.plans import resolve_splits, stage_splits

sys.path.insert(0, str(FIXTURES))
from plans import make_plan  # noqa: E402
from reference import train_reference  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "configs" / "models" / "gpt.py")
EAGER_LLAMA = str(FIXTURES / "eager_llama.py")
BATCH, LR = 4, 0.05


def _split_step(sequence_parallel: bool, model: str = GPT) -> tuple[list[dict[str, int]], int]:
    """Collectives of one forward and one backward of ``model`` split t=2 on a fake group
    (one process, each rank's local shapes), and the bytes its forward saves on this rank."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from pipeplan.tensor_parallel.apply import compute_context, parallelize_stage

    model_file = load_model_file(model)
    torch.manual_seed(0)
    network = model_file.build()
    inputs, targets = model_file.batch(BATCH, 0)
    graph = build_layer_graph(network, inputs)
    stage = graph.split([0] * len(graph.layers))[0]
    splits = stage_splits(stage.parameter_names, resolve_splits(network, None, {2}, model))
    dist.init_process_group("fake", store=dist.HashStore(), rank=0, world_size=2)
    try:
        parallelize_stage(stage.module, splits, init_device_mesh("cpu", (2,)), sequence_parallel)
        counts = []
        with compute_context("cpu"):
            with CommDebugMode() as mode:
                output = stage.module(*inputs.tensors())
            counts.append(mode.get_comm_counts())
            loss = model_file.loss_fn(output[-1], targets)
            with CommDebugMode() as mode:
                loss.backward()
            counts.append(mode.get_comm_counts())
            saved = _local_saved_bytes(stage.module, inputs.tensors())
    finally:
        dist.destroy_process_group()
    return [{str(op).split(".")[-1]: n for op, n in c.items()} for c in counts], saved


def _local_saved_bytes(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """Bytes of the distinct storages one forward saves on this rank (a DTensor: its local
    shard; ``count_saved`` would see the global shape of a DTensor wrapper)."""
    from torch.distributed.tensor import DTensor

    params = {
        p.to_local().untyped_storage().data_ptr() for p in module.parameters() if isinstance(p, DTensor)
    }
    storages: dict[int, int] = {}
    kept: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        storage = local.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
            kept.append(local)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        output = module(*inputs)
    del output
    kept.clear()
    return sum(storages.values())


@pytest.mark.slow  # the whole bundled GPT split over a fake group
@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_sequence_parallel_swaps_all_reduces_for_reduce_scatters_and_saves_less() -> None:
    plain, plain_bytes = _split_step(False)
    sequence, sequence_bytes = _split_step(True)
    assert [c.get("all_reduce", 0) for c in plain] == [4, 4]  # Megatron's 2 per block, each way
    # sequence parallel: each all-reduce a reduce-scatter (+ an all-gather before the next matmul)
    assert [c.get("all_reduce", 0) for c in sequence] == [0, 0]
    assert [c.get("reduce_scatter_tensor", 0) for c in sequence] == [4, 4]
    # held as sequence halves on each rank: the 5 layer norms' inputs and the head's (the residual
    # stream, (batch, seq, dim) float32), and the norms' mean and rstd (batch, seq, 1)
    halves = 6 * BATCH * 64 * 128 * 4 // 2 + 10 * BATCH * 64 * 1 * 4 // 2
    assert plain_bytes - sequence_bytes == halves


def _plan(model: str) -> Plan:
    """The whole model on one stage of t = 2 ranks, sequence-parallel."""
    layers = len(build_layer_graph(load_model_file(model).build(), load_model_file(model).batch(2, 0)[0]))
    plan = make_plan(model, [range(layers)], [1], batch_size=BATCH, microbatches=2, tensor_parallel=[2])
    return dataclasses.replace(plan, stages=(dataclasses.replace(plan.stages[0], sequence_parallel=True),))


@pytest.mark.slow  # a Hugging Face Llama split over a fake group
@pytest.mark.filterwarnings("ignore:Full backward hook")
def test_an_exported_llama_shards_its_sequence_by_propagation() -> None:
    """A torch.export capture calls no norm module: from the first reduce-scatter on, DTensor's
    propagation runs its RMS norms on sequence shards; Megatron's block all-reduces become
    reduce-scatters (the vocabulary-parallel embedding keeps its all-reduce)."""
    plain, _ = _split_step(False, EAGER_LLAMA)
    sequence, _ = _split_step(True, EAGER_LLAMA)
    assert [c.get("all_reduce", 0) for c in plain] == [5, 5]
    assert [c.get("all_reduce", 0) for c in sequence] == [1, 1]
    assert [c.get("reduce_scatter_tensor", 0) for c in sequence] == [4, 4]


@pytest.mark.multiprocess
@pytest.mark.parametrize("model", [GPT, EAGER_LLAMA], ids=["gpt-fx", "llama-export"])
def test_a_sequence_parallel_step_on_two_ranks_matches_the_unsharded_step(tmp_path: Path, model: str) -> None:
    _plan(model).save(tmp_path / "plan.json")
    args = [str(tmp_path / "plan.json"), "--model", model, "--steps", "1", "--lr", str(LR), "--no-progress"]
    result = torchrun(2, [*args, "--record", str(tmp_path / "rec")], timeout=240.0)
    assert result.returncode == 0, result.stderr[-3000:]
    reference, _ = train_reference(model, 1, BATCH, LR)
    recs = records(tmp_path / "rec")
    assert sorted(recs) == [0, 1]
    assert_params_match(recs, reference)  # both ranks: whole parameters equal to plain training
