"""Checkpoints keyed by qualified names: verified steps, restore under another split, weights in/out."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from pipeplan.errors import InputError
from pipeplan.runtime.checkpoint import state as ckstate
from pipeplan.runtime.checkpoint import store
from pipeplan.runtime.checkpoint.pretrained import load_weights

RUN = "run-aaaa"
LAYOUT = {"fingerprint": "p2", "replicas": [1, 2]}  # stage 1 has two replicas


def _chain(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 3))


def _trained(steps: int = 2) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _chain()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for k in range(steps):
        torch.manual_seed(100 + k)
        model(torch.randn(5, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _names(module: nn.Module) -> dict[str, str]:
    """Local state key -> qualified name (a slice of an ``nn.Sequential`` keeps the layer numbers)."""
    return {key: key for key in module.state_dict()}


def _save_split(directory: Path, step: int, model: nn.Sequential, optimizer: torch.optim.Optimizer) -> None:
    """Save ``model`` as the 2-stage layout: layers [0, 1] on stage 0, [2] on stage 1 (2 replicas)."""
    for stage, (first, last) in enumerate([(0, 2), (2, 3)]):
        part = model[first:last]
        names = _names(part)
        sub = torch.optim.Adam(part.parameters(), lr=0.01)
        sub.load_state_dict(_sub_state(optimizer, model, part))
        for replica in range(LAYOUT["replicas"][stage]):
            state = ckstate.rank_state(part, names, sub, weights=replica == 0)
            store.save_rank(
                directory,
                step,
                stage,
                replica,
                state,
                {"run_fingerprint": RUN, "run": {"seed": 0}, "layout": LAYOUT, "minibatches": step},
            )


def _sub_state(optimizer: torch.optim.Optimizer, model: nn.Module, part: nn.Module) -> dict:
    whole = list(model.parameters())
    state = optimizer.state_dict()
    positions = [next(i for i, p in enumerate(whole) if p is q) for q in part.parameters()]
    return {
        "state": {j: state["state"][i] for j, i in enumerate(positions)},
        "param_groups": [{**state["param_groups"][0], "params": list(range(len(positions)))}],
    }


def _flip(path: Path, count: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(100, 100 + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_step_restores_into_another_split_and_training_continues_exactly(tmp_path: Path) -> None:
    model, optimizer = _trained(2)
    _save_split(tmp_path, 2, model, optimizer)
    assert store.latest_complete_step(tmp_path, RUN) == (2, [])
    # one process holding the whole chain (another plan): every tensor and its Adam state come back
    fresh = _chain(seed=7)
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=0.01)
    index = ckstate.CheckpointIndex.of_step(str(tmp_path), 2)
    ckstate.restore_rank(index, fresh, _names(fresh), fresh_opt)
    for key, value in model.state_dict().items():
        torch.testing.assert_close(fresh.state_dict()[key], value, rtol=0, atol=0, msg=key)
    for reference, restored in ((model, optimizer), (fresh, fresh_opt)):
        torch.manual_seed(102)
        reference(torch.randn(5, 4)).square().mean().backward()
        restored.step()
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)


def test_a_flipped_file_skips_its_step_naming_the_file(tmp_path: Path) -> None:
    model, optimizer = _trained(1)
    _save_split(tmp_path, 1, model, optimizer)
    _save_split(tmp_path, 2, model, optimizer)
    _flip(store.rank_folder(tmp_path, 2, 1, 0) / "__0_0.distcp")
    step, skipped = store.latest_complete_step(tmp_path, RUN)
    assert step == 1
    assert skipped == [
        (2, "stage-01-replica-0/__0_0.distcp fails its sha256 (the file changed after it was written)")
    ]
    # a truncated file, a missing replica manifest, an old-format file: each named
    (store.rank_folder(tmp_path, 1, 0, 0) / ".metadata").write_bytes(b"x")
    assert "stage-00-replica-0/.metadata is 1 bytes" in store.step_problem(tmp_path, 1, RUN)
    store.rank_folder(tmp_path, 1, 1, 1).with_suffix(".json").unlink()
    assert (
        store.step_problem(tmp_path, 1, RUN) == "stage 1 replica 1 has no manifest (its save did not finish)"
    )
    assert store.latest_complete_step(tmp_path, RUN) == (
        None,
        [(2, skipped[0][1]), (1, store.step_problem(tmp_path, 1, RUN))],
    )
    (store.step_folder(tmp_path, 2) / "stage-00-replica-0.pt").write_bytes(b"old")
    assert "pipeplan.checkpoint/1" in store.step_problem(tmp_path, 2, RUN)


def test_another_runs_step_is_refused_and_pruning_keeps_two_complete_steps_of_this_run(
    tmp_path: Path,
) -> None:
    model, optimizer = _trained(1)
    for step in (1, 2, 3):
        _save_split(tmp_path, step, model, optimizer)
    with pytest.raises(InputError, match="was written by run run-aaaa, this run is run-bbbb"):
        store.latest_complete_step(tmp_path, "run-bbbb")
    assert store.prune_checkpoints(tmp_path, RUN, keep=2) == [1]
    assert store.step_folders(tmp_path) == [2, 3]
    store.rank_folder(tmp_path, 4, 0, 0).mkdir(parents=True)  # a save in progress: never pruned
    assert store.prune_checkpoints(tmp_path, RUN, keep=2) == [] and store.step_folders(tmp_path) == [2, 3, 4]
    assert store.discard_steps_after(tmp_path, 2, RUN) == [3, 4]


def test_a_missing_or_misshapen_weight_is_one_line(tmp_path: Path) -> None:
    model, optimizer = _trained(1)
    _save_split(tmp_path, 1, model, optimizer)
    index = ckstate.CheckpointIndex.of_step(str(tmp_path), 1)
    wide = nn.Sequential(nn.Linear(4, 7))
    with pytest.raises(
        InputError, match=r"checkpoint weight 0.weight has shape \[6, 4\], the model's is \[7, 4\]"
    ):
        ckstate.load_model_tensors(index, wide, {k: k for k in wide.state_dict()})
    with pytest.raises(InputError, match="the checkpoint has no weight 9.weight"):
        ckstate.load_model_tensors(index, wide, {"0.weight": "9.weight"})


class _Tied(nn.Module):
    """An embedding and a head sharing one weight (as GPT-2's wte and lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


@pytest.mark.parametrize("sharded", [False, True])
def test_weights_load_a_tied_tensor_saved_once_into_each_stage_holding_it(
    tmp_path: Path, sharded: bool
) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(3)
    source = _Tied()
    if sharded:  # the HF layout: an index naming each tensor's shard
        save_file({"head.weight": source.embed.weight.detach()}, str(tmp_path / "a.safetensors"))
        (tmp_path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": {"head.weight": "a.safetensors"}})
        )
    else:  # the library kept the tied tensor under its other name than the model's first
        save_file({"head.weight": source.embed.weight.detach()}, str(tmp_path / "model.safetensors"))
    aliases = {"embed.weight": ("embed.weight", "head.weight")}
    # the head alone (a last stage): its tensor is found under the tied name the file kept
    head = nn.Linear(4, 10, bias=False)
    assert load_weights(str(tmp_path), head, {"weight": "embed.weight"}, aliases) == 1
    torch.testing.assert_close(head.weight, source.embed.weight, rtol=0, atol=0)
    with pytest.raises(InputError, match=r"has no tensor embed.weight \(1 of this stage's parameters"):
        load_weights(str(tmp_path), nn.Linear(4, 10, bias=False), {"weight": "embed.weight"}, {})
    with pytest.raises(
        InputError, match=r"head.weight has shape \[10, 4\], the model's embed.weight is \[3, 4\]"
    ):
        load_weights(str(tmp_path), nn.Linear(4, 3, bias=False), {"weight": "embed.weight"}, aliases)
    (tmp_path / "nothing").mkdir()
    with pytest.raises(InputError, match="holds neither model.safetensors"):
        load_weights(str(tmp_path / "nothing"), head, {}, {})


def test_export_weights_of_a_plain_model_is_a_safetensors_file_load_model_reads(tmp_path: Path) -> None:
    from safetensors.torch import load_model

    from pipeplan.modelfile import load_model_file
    from pipeplan.runtime.checkpoint.write_weights import export_weights

    model_file = load_model_file(str(Path(__file__).parent / "fixtures" / "runtime" / "tied.py"))
    torch.manual_seed(5)
    trained = model_file.build()
    state = ckstate.rank_state(trained, {name: name for name, _ in trained.named_parameters()}, None)
    store.save_rank(
        tmp_path / "ckpt",
        1,
        0,
        0,
        state,
        {"run_fingerprint": RUN, "layout": {"replicas": [1]}, "minibatches": 1},
    )
    assert export_weights(str(tmp_path / "ckpt"), model_file, str(tmp_path / "out")) == "safetensors"
    torch.manual_seed(6)
    fresh = model_file.build()
    load_model(fresh, str(tmp_path / "out" / "model.safetensors"))
    for (name, a), b in zip(trained.state_dict().items(), fresh.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=name)
    assert fresh.head.weight is fresh.wte.weight  # the tied tensor was written once, re-tied on load
    with pytest.raises(InputError, match="already exists and is not an empty folder"):
        export_weights(str(tmp_path / "ckpt"), model_file, str(tmp_path / "out"))


def test_weights_from_a_pipeplan_checkpoint_take_its_newest_complete_step(tmp_path: Path) -> None:
    model, optimizer = _trained(1)
    _save_split(tmp_path, 1, model, optimizer)
    later, later_opt = _trained(2)
    _save_split(tmp_path, 2, later, later_opt)
    last_stage = nn.Sequential(nn.Linear(6, 3))  # holds layer 2 of the chain as its layer 0
    names = {"0.weight": "2.weight", "0.bias": "2.bias"}
    assert load_weights(str(tmp_path), last_stage, names, {}) == 2
    torch.testing.assert_close(last_stage[0].weight, later[2].weight, rtol=0, atol=0)
    load_weights(str(tmp_path / "step-000001"), last_stage, names, {})  # one step folder, named
    torch.testing.assert_close(last_stage[0].weight, model[2].weight, rtol=0, atol=0)
    _flip(store.rank_folder(tmp_path, 2, 1, 0) / "__0_0.distcp")
    with pytest.raises(
        InputError, match="step-000002 is not a complete checkpoint step: stage-01-replica-0/"
    ):
        load_weights(str(tmp_path / "step-000002"), last_stage, names, {})


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "deepseek_v3"])
def test_an_hf_moe_checkpoint_saved_per_expert_loads_as_from_pretrained_merges_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """transformers 5 saves MoE experts one tensor per expert (``experts.0.gate_proj.weight``) and
    merges them when it loads (``experts.gate_up_proj``): ``--weights`` makes each merged parameter
    as transformers does, equal to ``from_pretrained``'s. Without the conversions (an older
    library) it is one line naming the layout and the way around it, which loads too."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_model

    from pipeplan.runtime.checkpoint.pretrained import library_layout

    monkeypatch.syspath_prepend(str(Path(__file__).parent / "fixtures" / "models"))
    monkeypatch.setenv("PIPEPLAN_HF_FAMILY", family)
    from pipeplan.modelfile import load_model_file

    model_file = load_model_file(str(Path(__file__).parent / "fixtures" / "models" / "hf_family.py"))
    torch.manual_seed(5)
    model = model_file.build()
    model.save_pretrained(tmp_path / "hf", max_shard_size="20KB")  # sharded: experts across files
    reference = type(model).from_pretrained(tmp_path / "hf").state_dict()
    names = {name: name for name in model.state_dict()}
    layout = library_layout(model_file, str(tmp_path / "hf"))
    assert any(".experts." in name for name in layout)  # the checkpoint is stored per expert
    torch.manual_seed(6)
    fresh = model_file.build()
    assert load_weights(str(tmp_path / "hf"), fresh, names, {}, layout) == len(names)
    for name, value in reference.items():
        torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0, msg=name)

    merged = next(name for name in layout if name.endswith("experts.gate_up_proj"))
    expected = (
        rf"stores {merged.replace('.', '[.]')} as one tensor per module \(.*experts[.]0[.].*"
        r"save_model\(model, FILE\)"
        if family != "mixtral"
        # Mixtral's experts are renamed too
        else r"has no tensor model[.]layers[.]0[.]mlp[.]gate[.]weight"
    )
    with pytest.raises(InputError, match=expected):
        load_weights(str(tmp_path / "hf"), model_file.build(), names, {})
    save_model(type(model).from_pretrained(tmp_path / "hf"), str(tmp_path / "model.safetensors"))
    assert load_weights(str(tmp_path / "model.safetensors"), model_file.build(), names, {}) == len(names)


def test_export_weights_cli_errors_are_one_line(tmp_path: Path) -> None:
    from click.testing import CliRunner

    from pipeplan.cli import cli

    model = str(Path(__file__).parent / "fixtures" / "runtime" / "mlp.py")
    result = CliRunner().invoke(
        cli, ["export-weights", str(tmp_path / "none"), "--model", model, "-o", str(tmp_path / "o")]
    )
    assert (
        result.exit_code == 2 and result.output == f"error: checkpoint {tmp_path / 'none'} does not exist\n"
    )
    assert not (tmp_path / "o").exists()
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(
        cli, ["export-weights", str(tmp_path / "empty"), "--model", model, "-o", str(tmp_path / "o")]
    )
    assert result.exit_code == 2 and "holds no step-N folders of a pipeplan checkpoint" in result.output
    assert len(result.output.splitlines()) == 1 and not (tmp_path / "o").exists()


def test_lr_scheduler_state_rides_along_and_comes_back_under_another_split(tmp_path: Path) -> None:
    model, optimizer = _trained(1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    names = _names(model)
    store.save_rank(
        tmp_path,
        3,
        0,
        0,
        ckstate.rank_state(model, names, optimizer, scheduler),
        {"run_fingerprint": RUN, "layout": {"replicas": [1]}, "minibatches": 3},
    )
    part = model[2:3]  # another plan: a stage holding the last layer only
    part_opt = torch.optim.Adam(part.parameters(), lr=0.01)
    part_scheduler = torch.optim.lr_scheduler.StepLR(part_opt, step_size=2, gamma=0.5)
    ckstate.restore_rank(
        ckstate.CheckpointIndex.of_step(str(tmp_path), 3), part, _names(part), part_opt, part_scheduler
    )
    assert part_scheduler.state_dict() == scheduler.state_dict()
    assert part_scheduler.last_epoch == 3


def test_lr_scheduler_state_fits_a_stage_with_another_number_of_param_groups(tmp_path: Path) -> None:
    from pipeplan.optimizers import LRSchedule, make_lr_scheduler, make_optimizer, param_groups

    schedule = LRSchedule("cosine", warmup_steps=2, min_lr=0.0, total_steps=8)
    model, _ = _trained(1)  # weights (decay group) and biases/norm (no_decay group)

    def training(module: nn.Module) -> tuple[torch.optim.Optimizer, object]:
        optimizer = make_optimizer("adamw", param_groups(module.named_parameters()), 0.01, 0.1)
        scheduler = make_lr_scheduler(optimizer, schedule, 0.01)
        for _ in range(3):
            optimizer.step()
            scheduler.step()
        return optimizer, scheduler

    optimizer, scheduler = training(model)
    assert len(optimizer.param_groups) == 2
    store.save_rank(
        tmp_path,
        3,
        0,
        0,
        ckstate.rank_state(model, _names(model), optimizer, scheduler),
        {"run_fingerprint": RUN, "layout": {"replicas": [1]}, "minibatches": 3},
    )
    # another plan: a stage holding only a weight matrix has one group (empty ones are left out)
    weight_only = nn.Sequential(nn.Linear(4, 6, bias=False))
    part_opt = make_optimizer("adamw", param_groups(weight_only.named_parameters()), 0.01, 0.1)
    part_scheduler = make_lr_scheduler(part_opt, schedule, 0.01)
    ckstate.restore_rank(
        ckstate.CheckpointIndex.of_step(str(tmp_path), 3),
        weight_only,
        {"0.weight": "0.weight"},
        part_opt,
        part_scheduler,
    )
    assert part_scheduler.last_epoch == 3 and len(part_scheduler.base_lrs) == 1
    part_opt.step()
    part_scheduler.step()
    optimizer.step()
    scheduler.step()
    assert part_scheduler.get_last_lr()[0] == pytest.approx(scheduler.get_last_lr()[0], rel=1e-12)


def _split_round_trip(rank: int, port: int) -> None:
    """One of 2 gloo ranks: whole tensors in and out of DTensors of uneven and even splits."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from pipeplan.runtime.checkpoint.split import copy_whole, group_rng_states, shard_like, whole

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    try:
        mesh = init_device_mesh("cpu", (2,))
        for shape, placement in (
            ((5, 3), Shard(0)),
            ((3, 5), Shard(1)),
            ((7,), Shard(0)),
            ((4, 2), Shard(0)),
            ((2, 2), Replicate()),
        ):
            full = torch.arange(float(torch.Size(shape).numel())).view(shape)
            param = distribute_tensor(torch.zeros(shape), mesh, [placement])
            copy_whole(param, full)  # each rank keeps its chunk, as torch.chunk cuts it (5 rows: 3 | 2)
            dim = placement.dim if isinstance(placement, Shard) else None
            expected = full if dim is None else torch.chunk(full, 2, dim)[rank]
            assert torch.equal(param.to_local(), expected), (shape, rank)
            assert torch.equal(whole(param), full)  # gathered back whole, on the host
            state = shard_like(param, full.clone())
            assert isinstance(state, DTensor) and state.placements == param.placements
            assert torch.equal(state.to_local(), expected)
            assert not isinstance(shard_like(param, torch.tensor(3.0)), DTensor)  # Adam's step stays plain
        torch.manual_seed(10 + rank)
        states = group_rng_states(mesh)
        for j, saved in enumerate(states):
            torch.manual_seed(10 + j)
            assert torch.equal(saved, torch.get_rng_state())
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)  # passed: skip interpreter teardown, where torch's store threads sometimes abort (SIGABRT)


@pytest.mark.multiprocess
def test_split_tensors_load_each_ranks_chunk_and_save_whole() -> None:
    """2 gloo ranks: a whole tensor copied into a DTensor leaves each rank DTensor's own chunk
    (uneven 5 = 3 + 2 rows included), gathers back equal, optimizer states take the
    parameter's placements (a scalar does not), and the group's RNG states come back in rank order."""
    from spawned_ranks import run_ranks

    run_ranks(_split_round_trip, 2)
