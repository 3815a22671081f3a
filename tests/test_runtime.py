"""Runtime pieces without torchrun: tags, headers, weight stash, data, stage building,
and a one-rank run in this process (gloo, world size 1)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from ports import free_port
from torch import nn

from pipeplan.errors import InputError, RuntimeFailure
from pipeplan.modelfile import load_model_file
from pipeplan.runtime.comm import BACKWARD, FORWARD, TensorSpec, message_tag, short_reason
from pipeplan.runtime.config import OptimizerConfig, OutputConfig, RunConfig, ScheduleConfig
from pipeplan.runtime.data import BatchSource
from pipeplan.runtime.launch import check_world_size, choose_backend, read_env
from pipeplan.runtime.stage import build_pipeline, stage_of_layers
from pipeplan.runtime.stash import WeightStash
from pipeplan.runtime.train import run_training, steps_period

FIXTURES = Path(__file__).parent / "fixtures" / "runtime"
sys.path.insert(0, str(FIXTURES))

from plans import make_plan  # noqa: E402
from reference import train_reference  # noqa: E402


def test_message_tags_are_unique_per_value_unit_direction_and_header() -> None:
    tags = {
        message_tag(value, 5, unit, direction, header)
        for value in range(5)
        for unit in range(40)
        for direction in (FORWARD, BACKWARD)
        for header in (False, True)
    }
    assert len(tags) == 5 * 40 * 2 * 2
    # past 2**31 / (4 * values) units the tags wrap instead of overflowing (issue 13)
    assert message_tag(0, 1000, 2**22, FORWARD) == message_tag(0, 1000, 2**22 % 536870, FORWARD)
    with pytest.raises(RuntimeFailure, match="leave room for only"):
        message_tag(0, 2**20, 0, FORWARD)


def test_tensor_header_round_trip() -> None:
    for spec in (
        TensorSpec((4, 3, 2), torch.float32),
        TensorSpec((7,), torch.int64),
        TensorSpec((), torch.bfloat16),
    ):
        assert TensorSpec.decode(spec.encode("cpu")) == spec
    assert (
        short_reason(RuntimeError("[a/b.cc:1] Timed out waiting 1000ms. This is typically x"))
        == "Timed out waiting 1000ms"
    )


def test_weight_stash_keeps_the_forward_version_for_backward() -> None:
    torch.manual_seed(0)
    module = nn.Linear(3, 2)
    stash = WeightStash(module, max_versions=2)
    x = torch.randn(4, 3)
    v0 = stash.acquire()
    out0 = stash.forward(v0, (x,))
    torch.testing.assert_close(out0, module(x))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    # a step on the live weights (as for another minibatch) between forward and backward
    module(x).sum().backward()
    optimizer.step()
    stash.stepped()
    v1 = stash.acquire()
    assert (v0.id, v1.id) == (0, 1)
    assert not torch.equal(v0.params["weight"], v1.params["weight"])
    out0.sum().backward()
    grads = stash.collect_grads(v0)
    # the gradient w.r.t. the bias is the batch size; w.r.t. the weight it is x summed
    torch.testing.assert_close(grads["weight"], x.sum(0).expand(2, 3))
    assert 0 not in stash.versions and stash.peak_versions == 2
    stash.acquire()  # second user of version 1 is fine
    stash.stepped()
    stash.acquire()  # version 2 while 1 is in use: 2 versions in use
    with pytest.raises(RuntimeFailure, match="3 versions in use, more than the 2"):
        stash.stepped()
        stash.acquire()


def test_batch_source_microbatches_and_seeds() -> None:
    model_file = load_model_file(FIXTURES / "mlp.py")
    source = BatchSource(model_file, batch_size=8, microbatches=4, seed=10, loader_replicas=1)
    whole_inputs, whole_targets = model_file.batch(8, seed=13)
    chunks = [source.microbatch(3, m) for m in range(4)]
    torch.testing.assert_close(torch.cat([c[0][0] for c in chunks]), whole_inputs[0])
    torch.testing.assert_close(torch.cat([c[1] for c in chunks]), whole_targets)
    with pytest.raises(InputError, match="not divisible into 3"):
        BatchSource(model_file, batch_size=8, microbatches=3, seed=0, loader_replicas=1)


def test_batch_source_draws_ahead_within_its_bounds() -> None:
    model_file = load_model_file(FIXTURES / "mlp.py")
    source = BatchSource(model_file, batch_size=8, microbatches=2, seed=10, loader_replicas=1)
    assert source.draw_ahead(range(5, 1000), most=4) == 4 and sorted(source._cache) == [5, 6, 7, 8]
    one = sum(t.numel() * t.element_size() for t in (*source.microbatch(5, 0)[0], source.microbatch(5, 0)[1]))
    assert BatchSource(model_file, 8, 2, 10, 1).draw_ahead(range(100), budget_bytes=3 * 2 * one) == 3
    for k in range(5, 9):  # the drawn ones are the minibatches an on-demand draw gives
        inputs, targets = model_file.batch(8, seed=10 + k)
        torch.testing.assert_close(torch.cat([source.microbatch(k, m)[1] for m in range(2)]), targets)
    assert sorted(source._cache) == [7, 8]  # taking minibatch 8 let go of those before 7
    assert sorted(source._chunks) == [7, 8]  # and of their split, kept beside


def test_batch_source_splits_a_minibatch_once() -> None:
    """Every forward asks for its micro-batch: the minibatch is cut at the first ask only."""
    source = BatchSource(load_model_file(FIXTURES / "mlp.py"), 8, 4, seed=10, loader_replicas=1)
    first = [source.microbatch(2, m) for m in range(4)]
    again = [source.microbatch(2, m) for m in range(4)]
    assert all(a[0][0] is b[0][0] and a[1] is b[1] for a, b in zip(first, again))
    assert [chunk[1].shape[0] for chunk in first] == [2, 2, 2, 2]


def test_batch_source_shards_a_data_loader_like_pipedream(tmp_path: Path) -> None:
    path = tmp_path / "loader.py"
    path.write_text(
        "import torch\n"
        "def build_model():\n    return torch.nn.Sequential(torch.nn.Linear(1, 1))\n"
        "def sample_batch(n):\n    return torch.zeros(n, 1), torch.zeros(n, 1)\n"
        "def data_loader(batch_size, replica, replicas):\n"
        "    for i in range(3):\n"
        "        v = float(100 * replica + 10 * replicas + i)\n"
        "        yield torch.full((batch_size, 1), v), torch.full((batch_size, 1), v)\n"
    )
    source = BatchSource(load_model_file(path), batch_size=2, microbatches=1, seed=0, loader_replicas=2)
    # minibatch k is item k // 2 of loader k % 2; a rank may skip minibatches of other replicas
    firsts = [float(source.microbatch(k, 0)[0][0][0, 0]) for k in (1, 4, 5)]
    assert firsts == [120.0, 22.0, 122.0]
    with pytest.raises(InputError, match="ended after 3 minibatches; the run needs 4"):
        source.microbatch(7, 0)


def test_launch_checks() -> None:
    assert choose_backend("cuda", True) == "nccl" and choose_backend("cuda", False) == "gloo"
    plan = make_plan(str(FIXTURES / "mlp.py"), [[0, 1, 2], [3, 4, 5]], [1, 1])
    with pytest.raises(InputError, match="must be started by torchrun"):
        read_env(plan, {})
    env = read_env(plan, {"RANK": "1", "WORLD_SIZE": "3"})
    assert (env.rank, env.world_size, env.backend, env.device) == (1, 3, "gloo", "cpu")
    with pytest.raises(InputError, match="plan is for 2 ranks but torchrun started 3"):
        check_world_size(plan, env)


def test_build_pipeline_finds_skips_and_ties() -> None:
    dag = str(FIXTURES / "dag.py")
    plan = make_plan(dag, [[0], [1, 2], [3], [4, 5]], [1, 1, 1, 1])
    spec = build_pipeline(load_model_file(dag), plan, rank=3, seed=0, sample_batch_size=4)
    assert spec.stage_index == 3 and spec.stage is not None
    assert sorted(spec.stage.producers.values()) == [0, 2]  # the skip from stage 0 arrives directly
    tied = str(FIXTURES / "tied.py")
    tied_plan = make_plan(tied, [[0, 1], [2, 3, 4]], [1, 1])
    spec = build_pipeline(load_model_file(tied), tied_plan, rank=0, seed=0, sample_batch_size=4)
    assert spec.tie_groups == {(0, 1): ("wte.weight",)}
    with pytest.raises(InputError, match="does not match the plan"):
        build_pipeline(load_model_file(dag), tied_plan, rank=0, seed=0, sample_batch_size=4)
    with pytest.raises(InputError, match=r"assigns no stage to layers \[6\] \(model has 7 layers\)"):
        stage_of_layers(plan, 7)  # a plan for 6 layers, a model of 7


def test_steps_period() -> None:
    assert steps_period("1f1b-rr", (2, 1, 3)) == 6
    assert steps_period("gpipe", (2, 2)) == 1


@pytest.mark.parametrize("schedule", ["1f1b-flush", "gpipe"])
def test_one_rank_run_in_process_equals_plain_training(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, schedule: str
) -> None:
    model = str(FIXTURES / "mlp.py")
    plan = make_plan(model, [[0, 1, 2, 3, 4, 5]], [1], schedule, batch_size=8, microbatches=2)
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)
    config = RunConfig(
        plan=plan,
        model_path=model,
        steps=3,
        optim=OptimizerConfig(optimizer="sgd", lr=0.05),
        pipeline=ScheduleConfig(schedule=schedule, microbatches=2, recompute=schedule == "gpipe"),
        outputs=OutputConfig(record_dir=str(tmp_path), progress=False),
    )
    summary = run_training(config)
    assert summary is not None and summary["steps"] == 3
    reference, losses = train_reference(model, 3, 8, 0.05)
    assert summary["losses"] == pytest.approx(losses, rel=1e-5)
    record = torch.load(tmp_path / "rank0.pt")
    for name, value in record["params"].items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)


def test_cli_refuses_a_launch_without_torchrun(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeplan.cli import cli

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    model = str(FIXTURES / "mlp.py")
    make_plan(model, [[0, 1, 2], [3, 4, 5]], [1, 1]).save(tmp_path / "plan.json")
    result = CliRunner().invoke(cli, ["run", str(tmp_path / "plan.json"), "--model", model])
    assert result.exit_code == 2
    assert result.output.strip().startswith("error: pipeplan run must be started by torchrun")
    assert "Traceback" not in result.output
    help_text = CliRunner().invoke(cli, ["run", "--help"]).output
    assert "--checkpoint-every" in help_text and "torchrun --nproc-per-node" in help_text


def test_watchdog_notices_a_silent_rank_and_a_reported_failure() -> None:
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from pipeplan.runtime.failure import Watchdog

    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    seen: dict[int, str] = {}
    done = threading.Event()

    def catcher(rank: int):
        def on_failure(message: str) -> None:
            seen[rank] = message
            done.set()

        return on_failure

    dogs = [
        Watchdog(
            r,
            2,
            "127.0.0.1",
            port,
            prefix="a/",
            interval_s=0.05,
            heartbeat_timeout_s=0.5,
            on_failure=catcher(r),
        )
        for r in range(2)
    ]
    for dog in dogs:
        dog.start()
    dogs[1].stop()  # rank 1 goes silent (as if SIGKILLed)
    assert done.wait(5.0)
    assert seen == {0: seen[0]} and seen[0].startswith(
        "rank 0 stops because rank 1 died or stopped (no heartbeat for"
    )
    dogs[0].stop()

    seen.clear()
    done.clear()
    dogs = [
        Watchdog(
            r,
            2,
            "127.0.0.1",
            port,
            prefix="b/",
            interval_s=0.05,
            heartbeat_timeout_s=30.0,
            on_failure=catcher(r),
        )
        for r in range(2)
    ]
    for dog in dogs:
        dog.start()
    dogs[1].report("rank 1: boom")
    assert done.wait(5.0)
    assert seen == {0: "rank 0 stops because rank 1 failed: rank 1: boom"}
    assert dogs[0].failed_rank() == (1, "rank 1: boom")
    dogs[0].publish("loss/0", "1.5")
    assert dogs[1].peek("loss/0") == "1.5" and dogs[1].peek("loss/1") is None
    for dog in dogs:
        dog.stop()
    del master


def test_a_minibatchs_stashed_weight_gradients_add_in_place() -> None:
    """2BW with 2 micro-batches: each unit's gradients, moved out of its weight version, are
    added into the minibatch's kept ones in place (the same tensor after), so a backward's
    gradients, the kept ones and no third copy exist at once; the sum is exact."""
    from pipeplan.profiler.live_bytes import LiveBytes
    from pipeplan.runtime.executor import UnitRecord, _Saved
    from pipeplan.schedules import Action
    from tests.test_comm_sends import _executor

    torch.manual_seed(0)
    module = nn.Linear(256, 256, bias=False)  # a 256 KiB weight
    stash = WeightStash(module, max_versions=2, delayed=True)
    executor = _executor("2bw", comm=None, microbatches=2, stash=stash)
    xs = [torch.randn(4, 256) for _ in range(2)]
    version = stash.acquire(0)
    stash.acquire(0)  # both micro-batches of minibatch 0 run on version 0
    for m, x in enumerate(xs):
        executor.units[m] = UnitRecord(0, m, version.id)
        stash.forward(version, (x,)).sum().backward()
        action = Action("B", 0, m)
        if m == 0:
            executor._weights_done(action, _Saved([], {}, None, version))
            kept = executor._minibatch_grads[0]["weight"]
            continue
        with LiveBytes() as live:
            executor._weights_done(action, _Saved([], {}, None, version))
    assert executor._minibatch_grads[0]["weight"] is kept  # added into, not replaced
    assert live.peak == 0  # out of place, the sum was a new 256 KiB tensor
    torch.testing.assert_close(kept, sum(x.sum(0) for x in xs).expand(256, 256))
