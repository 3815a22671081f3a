"""The fault matrix of issue 13: bad inputs, write failures, NaN losses, stopped or dead
processes, checkpoints of two runs in one directory.

Every case asserts the exit code, the one ``error:`` line, and that no process and no
partial (temp) file is left. Multi-process cases run on gloo with ``--timeout 4`` (so
a stopped rank or store is declared dead after 4 s instead of 20 s) and a hard
subprocess timeout; stopped processes are continued and killed in teardown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from ports import free_port

from pipeplan.cli import cli
from pipeplan.errors import InputError, RuntimeFailure
from pipeplan.jsonio import read_json_object, write_json_atomic
from pipeplan.plan import Plan
from pipeplan.profiler.pipedream_graph import load_pipedream_graph
from pipeplan.runtime.comm import BACKWARD, FORWARD, message_tag

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES / "runtime"))

from plans import make_plan  # noqa: E402

VGG = FIXTURES / "pipedream" / "vgg16" / "graph.txt"
MLP = str(FIXTURES / "runtime" / "mlp.py")
NAN_MLP = str(FIXTURES / "runtime" / "nan_mlp.py")
TIMEOUT_S = "4"  # --timeout of the multi-process cases: heartbeat and store bound 4 s


def invoke(args: list[str]) -> Any:
    return CliRunner().invoke(cli, args, catch_exceptions=False)


def assert_one_error_line(output: str, fragment: str) -> None:
    lines = [line for line in output.splitlines() if line.strip()]
    assert "Traceback" not in output, output
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and fragment in errors[0], output


def leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*.tmp"))


# --------------------------------------------------------------------- profiles


def vgg_profile() -> dict[str, Any]:
    return load_pipedream_graph(VGG).to_dict()


def _set(path: list[Any], value: Any):
    def change(raw: dict[str, Any]) -> None:
        node = raw
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_set(["data_ms"], -100), "profile data_ms = -100 is outside [0, 1e+09]"),
        (_set(["optimizer_ms"], {"sgd": -1.5}), "profile optimizer_ms['sgd'] = -1.5 is outside"),
        (
            _set(["optimizer_ms"], "fast"),
            "field 'optimizer_ms' must be an object of a finite number, got 'fast'",
        ),
        (
            _set(["layers", 1, "inputs"], [0.5]),
            "layers[1]: field 'inputs' must be a list of an integer, got [0.5]",
        ),
        (_set(["layers", 0, "forward_ms"], 1e308), "forward_ms = 1e+308 is outside [0, 1e+09]"),
        (_set(["layers", 0, "backward_ms"], -3.0), "backward_ms = -3.0 is outside"),
        (_set(["batch_size"], "32"), "field 'batch_size' must be an integer, got '32'"),
        (_set(["layers", 2, "colour"], "red"), "layers[2]: unknown field 'colour'"),
    ],
)
def test_bad_profile_values_are_one_line(tmp_path: Path, change: Any, message: str) -> None:
    raw = vgg_profile()
    change(raw)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(raw))
    result = invoke(["partition", str(path), "--topology", "cluster-a", "-o", str(tmp_path / "plan.json")])
    assert result.exit_code == 2
    assert_one_error_line(result.output, message)
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"loss_ms": Infinity}', "Infinity is not a JSON number"),
        ('{"a": 1, "a": 2}', "duplicate key 'a'"),
        ("[" * 100_000 + "]" * 100_000, "is nested deeper than 64 levels"),
    ],
    ids=["infinity", "duplicate-key", "deep-nesting"],
)
def test_json_that_python_accepts_but_a_contract_must_not(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "profile.json"
    path.write_text(text)
    result = invoke(["partition", str(path), "--topology", "cluster-a"])
    assert result.exit_code == 2
    assert_one_error_line(result.output, message)


def test_non_utf8_inputs_are_one_line(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    path.write_bytes(b'{"schema": "\xff\xfe"}')
    result = invoke(["partition", str(path), "--topology", "cluster-a"])
    assert result.exit_code == 2
    assert_one_error_line(result.output, "is not UTF-8 text (byte 12)")
    with pytest.raises(InputError, match="is not UTF-8"):
        read_json_object(path)
    topo = tmp_path / "t.yaml"
    topo.write_bytes(b"name: \xff\n")
    result = invoke(["partition", str(VGG), "--topology", str(topo)])
    assert result.exit_code == 2
    assert_one_error_line(result.output, "is not UTF-8 text")


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("inf", "size 'inf' must be a finite number >= 0"),
        ("nan", "size 'nan' must be a finite number >= 0"),
        ("-4.0", "size '-4.0' must be a finite number >= 0"),
    ],
)
def test_pipedream_graph_sizes_must_be_finite(tmp_path: Path, size: str, message: str) -> None:
    lines = VGG.read_text().splitlines()
    lines[0] = (
        lines[0].replace("activation_size=", f"activation_size={size}, was=").split(", was=")[0]
        + ", parameter_size=0.000"
    )
    graph = tmp_path / "graph.txt"
    graph.write_text("\n".join(lines) + "\n")
    result = invoke(["partition", str(graph), "--topology", "cluster-a"])
    assert result.exit_code == 2
    assert_one_error_line(result.output, f"graph.txt:1: {message}")


# ------------------------------------------------------------------ topologies


@pytest.mark.parametrize(
    ("level", "message"),
    [
        (
            "  - {name: s, count: 2, bandwidth: 5 GB/s, latncy: 5 us}",
            "t.yaml:4: unknown key 'latncy' in 'levels[0]' (allowed: name, count, bandwidth, latency, message_overhead)",
        ),
        (
            "  - name: s\n    count: 2\n    bandwidth: 5 GB/s\n    count: 8",
            "t.yaml:7: duplicate key 'count' in 'levels[0]' (first on line 5)",
        ),
    ],
)
def test_topology_unknown_and_duplicate_keys(tmp_path: Path, level: str, message: str) -> None:
    topo = tmp_path / "t.yaml"
    topo.write_text(f"name: x\ndevice: {{name: a, memory: 16 GiB}}\nlevels:\n{level}\n")
    result = invoke(["partition", str(VGG), "--topology", str(topo)])
    assert result.exit_code == 2
    assert_one_error_line(result.output, message)


# ------------------------------------------------------------------------ plans


def mlp_plan_dict() -> dict[str, Any]:
    return make_plan(MLP, [[0, 1, 2], [3, 4, 5]], [1, 1]).to_dict()


def _stage(index: int, **values: Any):
    def change(raw: dict[str, Any]) -> None:
        raw["stages"][index].update(values)

    return change


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_stage(1, layers=[2, 3, 4, 5], layer_start=2), "plan stages 0 and 1 both hold layer 2"),
        (_stage(1, layers=[4, 5], layer_start=4), "plan assigns no stage to layers [3] of 0..5"),
        (_stage(0, layers=["a"]), "stages[0]: field 'layers' must be a list of an integer, got ['a']"),
        (_stage(0, layer_end=2), "layer_start/layer_end [0, 2) do not match its layers (min 0, max 2)"),
        (_stage(0, shedule="1f1b"), "stages[0]: unknown field 'shedule'"),
        (_set(["batch_size"], 0), "plan batch_size must be >= 1 (got 0)"),
        (_set(["microbatches"], 3), "plan batch_size 8 is not divisible into 3 micro-batches"),
        (_set(["schedule"], "pipedream"), "plan schedule 'pipedream' is not one of"),
        (_set(["colour"], "red"), "plan.json: unknown field 'colour'"),
        (_set(["topology", "levels", 0, "count"], 0), "topology levels[0]: count 0 must be >= 1"),
    ],
)
def test_bad_plans_are_one_line(tmp_path: Path, change: Any, message: str) -> None:
    raw = mlp_plan_dict()
    change(raw)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match=None) as caught:
        Plan.load(path)
    assert message in str(caught.value) and "\n" not in str(caught.value)
    result = invoke(["simulate", str(path)])
    assert result.exit_code == 2
    assert_one_error_line(result.output, message)


def test_non_contiguous_layer_sets_are_a_valid_plan(tmp_path: Path) -> None:
    raw = mlp_plan_dict()
    raw["stages"][0].update(layers=[0, 1, 3], layer_start=0, layer_end=4)
    raw["stages"][1].update(layers=[2, 4, 5], layer_start=2, layer_end=6)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(raw))
    plan = Plan.load(path)
    assert [s.layers for s in plan.stages] == [(0, 1, 3), (2, 4, 5)]


# ---------------------------------------------------------------- write errors


def test_output_under_a_file_is_one_line_and_no_file(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    out = blocker / "plan.json"
    result = invoke(["partition", str(VGG), "--topology", "cluster-a", "-o", str(out)])
    assert result.exit_code == 2
    assert_one_error_line(result.output, f"cannot write {out}: {blocker} is a file, not a folder")
    plan = tmp_path / "plan.json"
    assert invoke(["partition", str(VGG), "--topology", "cluster-a", "-o", str(plan)]).exit_code == 0
    result = invoke(["simulate", str(plan), "--timeline", str(blocker / "t.svg")])
    assert result.exit_code == 2
    assert_one_error_line(result.output, f"cannot write {blocker / 't.svg'}: {blocker} is a file")


def test_full_disk_during_profile_is_one_line_and_no_partial_file(tmp_path: Path, monkeypatch: Any) -> None:
    real_fsync = os.fsync

    def full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    out = tmp_path / "profile.json"
    monkeypatch.setattr(os, "fsync", full)
    result = invoke(["profile", MLP, "-b", "4", "--warmup", "0", "--repeats", "1", "-o", str(out)])
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert result.exit_code == 2
    assert_one_error_line(result.output, f"cannot write {out}: No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_outputs_get_the_umask_mode(tmp_path: Path) -> None:
    old = os.umask(0o027)
    try:
        write_json_atomic(tmp_path / "a.json", {"x": 1})
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.json").stat().st_mode) == 0o640


def test_non_finite_values_are_written_as_null() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "m.json"
        write_json_atomic(path, {"losses": [1.5, float("nan"), float("inf")]})
        assert read_json_object(path) == {"losses": [1.5, None, None]}


# ------------------------------------------------------------------ NaN losses


def test_profile_of_a_nan_loss_is_refused_unless_allowed(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    args = ["profile", NAN_MLP, "-b", "4", "--warmup", "0", "--repeats", "1", "-o", str(out)]
    result = invoke(args)
    assert result.exit_code == 2
    assert_one_error_line(result.output, "the loss is nan at step 0 (the check pass, whole model")
    assert not out.exists()
    assert invoke([*args, "--allow-nonfinite"]).exit_code == 0 and out.exists()


# ---------------------------------------------------------------- message tags


def test_message_tags_wrap_and_stay_unique_across_the_wrap() -> None:
    values = 64  # the audit's case: 64 values x 16 micro-batches overflowed at 524,288 steps
    window = 2**31 // (values * 4)
    assert window == 8_388_608
    units = range(window - 50, window + 50)  # 100 units around the wrap point
    tags = {message_tag(v, values, u, d) for v in range(values) for u in units for d in (FORWARD, BACKWARD)}
    assert len(tags) == values * 100 * 2
    assert max(tags) < 2**31
    late = 16 * 600_000  # unit of minibatch 600,000: past the old overflow
    assert message_tag(3, values, late, FORWARD) == message_tag(3, values, late - window, FORWARD)


# ---------------------------------------------------------------- checkpoints


def test_restore_keeps_this_runs_lr_and_refuses_state_that_does_not_fit(tmp_path: Path) -> None:
    from pipeplan.runtime.checkpoint import state as ckstate
    from pipeplan.runtime.checkpoint import store

    module = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    names = {"weight": "fc.weight", "bias": "fc.bias"}
    store.save_rank(
        tmp_path,
        3,
        0,
        0,
        ckstate.rank_state(module, names, optimizer),
        {"run_fingerprint": "run-x", "layout": {"replicas": [1]}, "minibatches": 3},
    )
    index = ckstate.CheckpointIndex.of_step(str(tmp_path), 3)
    fresh = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)
    ckstate.restore_rank(index, module, names, fresh)
    assert [g["lr"] for g in fresh.param_groups] == [0.2]
    torch.testing.assert_close(
        fresh.state_dict()["state"][0]["momentum_buffer"],
        optimizer.state_dict()["state"][0]["momentum_buffer"],
        rtol=0,
        atol=0,
    )
    other = torch.nn.Linear(3, 2)
    with pytest.raises(
        InputError, match=r"checkpoint weight fc.weight has shape \[2, 2\], the model's is \[2, 3\]"
    ):
        ckstate.restore_rank(index, other, names, torch.optim.SGD(other.parameters(), lr=0.2))


def test_pruning_touches_only_this_runs_folders(tmp_path: Path) -> None:
    from pipeplan.runtime.checkpoint import store

    def save(step: int, run: str) -> None:
        store.save_rank(
            tmp_path,
            step,
            0,
            0,
            {"x": torch.tensor(step)},
            {"run_fingerprint": run, "layout": {"replicas": [1]}, "minibatches": step},
        )

    for step in (1, 2):
        save(step, "run-other")
    for step in (3, 4, 5):
        save(step, "run-mine")
    assert store.prune_checkpoints(tmp_path, "run-mine", keep=2) == [3]
    assert store.step_folders(tmp_path) == [1, 2, 4, 5]


# ------------------------------------------------------- multi-process harness


def base_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1"}


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == str(pid):
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class Launch:
    """Processes of one test; teardown continues and kills whatever is left."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []
        self.pids: list[int] = []

    def start(self, args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.procs.append(proc)
        self.pids.append(proc.pid)
        return proc

    def plain(
        self,
        nproc: int,
        args: list[str],
        extra: dict[str, str] | None = None,
        port: int | None = None,
        ranks: list[int] | None = None,
    ) -> list[subprocess.Popen[str]]:
        """Ranks started as torchrun would (its variables), without the agent: rank 0 hosts the store."""
        port = port or free_port()
        return [
            self.start(
                [sys.executable, "-m", "pipeplan", "run", *args],
                {
                    **base_env(),
                    **(extra or {}),
                    "RANK": str(rank),
                    "WORLD_SIZE": str(nproc),
                    "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port),
                },
            )
            for rank in (ranks if ranks is not None else range(nproc))
        ]

    def cleanup(self) -> None:
        for pid in self.pids:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        for proc in self.procs:
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass


@pytest.fixture
def launch() -> Iterator[Launch]:
    runner = Launch()
    try:
        yield runner
    finally:
        runner.cleanup()


def wait_for_training(folder: Path, procs: list[subprocess.Popen[str]], limit_s: float = 90.0) -> None:
    """Until a checkpoint step folder exists in ``folder`` (training is under way; older
    steps are pruned within milliseconds, so any step counts); fails at once, with their
    stderr, if a process ended first."""
    end = time.monotonic() + limit_s
    while not any(folder.glob("step-*")):
        ended = [p for p in procs if p.poll() is not None]
        assert not ended, [(p.returncode, p.communicate()[1][-2000:]) for p in ended]
        if time.monotonic() > end:  # dump every thread's stack (faulthandler) for the report
            for proc in procs:
                os.kill(proc.pid, signal.SIGABRT)
            stacks = [p.communicate(timeout=30)[1][-6000:] for p in procs]
            raise AssertionError(f"no step folder in {folder} within {limit_s} s: {stacks}")
        time.sleep(0.1)


def finish(proc: subprocess.Popen[str], limit_s: float = 60.0) -> tuple[int, str]:
    _, err = proc.communicate(timeout=limit_s)
    return proc.returncode, err


def rr_plan(
    tmp_path: Path,
    model: str = MLP,
    layers: list[list[int]] | None = None,
    optimizer: str = "sgd",
    name: str = "plan.json",
) -> str:
    path = tmp_path / name
    make_plan(
        model, layers or [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-flush", batch_size=8, optimizer=optimizer
    ).save(path)
    return str(path)


def long_run(tmp_path: Path, plan: str) -> list[str]:
    """Runs long enough to be stopped; step folders appear once training is under way."""
    return [
        plan,
        "--model",
        MLP,
        "--steps",
        "100000",
        "--no-progress",
        "--timeout",
        TIMEOUT_S,
        "--checkpoint-dir",
        str(tmp_path / "ckpt"),
        "--checkpoint-every",
        "1",
    ]


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("stopped", "messages"),
    [
        (0, ("rank 1: the rendezvous store at 127.0.0.1:",)),  # rank 0 hosts the store (no agent)
        # whichever bound fires first names rank 1: the heartbeat, or the wait for its message
        (
            1,
            (
                "rank 0 stops because rank 1 died or stopped (no heartbeat for",
                "from rank 1 failed: no answer within 4 s; rank 1 failed or died",
            ),
        ),
    ],
    ids=["store-host", "other-rank"],
)
def test_sigstop_of_a_rank_ends_the_other_rank(
    tmp_path: Path, launch: Launch, stopped: int, messages: tuple[str, ...]
) -> None:
    """A SIGSTOPped rank (the store host, or not): the other exits 2 naming it within the bound."""
    procs = launch.plain(2, long_run(tmp_path, rr_plan(tmp_path)))
    wait_for_training(tmp_path / "ckpt", procs)
    os.kill(procs[stopped].pid, signal.SIGSTOP)
    started = time.monotonic()
    code, err = finish(procs[1 - stopped])
    detected_s = time.monotonic() - started
    assert code == 2
    errors = [line for line in err.splitlines() if line.startswith("error: ")]
    assert "Traceback" not in err and len(errors) == 1, err
    assert any(message in errors[0] for message in messages), err
    assert detected_s < 4.0 + 10.0, detected_s  # bound: --timeout 4 s, plus load slack
    print(f"rank {stopped} SIGSTOPped: rank {1 - stopped} exited 2 after {detected_s:.1f} s")


@pytest.mark.multiprocess
def test_sigstop_of_the_torchrun_agent_ends_every_rank(tmp_path: Path, launch: Launch) -> None:
    """The agent hosts the store and is SIGSTOPped: both workers exit 2 naming the store."""
    agent = launch.start(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            "--master-port",
            str(free_port()),
            "-m",
            "pipeplan",
            "run",
            *long_run(tmp_path, rr_plan(tmp_path)),
        ],
        base_env(),
    )
    wait_for_training(tmp_path / "ckpt", [agent])
    workers = children(agent.pid)
    assert len(workers) == 2, workers
    launch.pids.extend(workers)
    os.kill(agent.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    while any(alive(pid) for pid in workers):
        assert time.monotonic() - stopped < 30.0, "workers still alive 30 s after the agent stopped"
        time.sleep(0.1)
    detected_s = time.monotonic() - stopped
    assert detected_s < 4.0 + 10.0, detected_s
    os.kill(agent.pid, signal.SIGCONT)  # the agent now reaps its failed workers and exits
    code, err = finish(agent)
    assert code != 0
    assert (
        sum("has not answered for" in line for line in err.splitlines() if line.startswith("error: rank "))
        == 2
    )
    print(f"agent SIGSTOPped: both workers exited after {detected_s:.1f} s")


@pytest.mark.multiprocess
def test_master_port_held_by_a_non_store_listener_is_bounded(tmp_path: Path, launch: Launch) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        port = listener.getsockname()[1]
        started = time.monotonic()
        (proc,) = launch.plain(
            2, [rr_plan(tmp_path), "--model", MLP, "--no-progress", "--timeout", "3"], port=port, ranks=[1]
        )
        code, err = finish(proc, 60)
        elapsed = time.monotonic() - started
    assert code == 2
    assert_one_error_line(err, f"rank 1: cannot join the process group at 127.0.0.1:{port} within 3 s")
    assert elapsed < 3.0 + 20.0, elapsed  # start-up (torch import, model) + the 3 s bound


@pytest.mark.multiprocess
def test_two_runs_cannot_clobber_each_others_checkpoints_and_the_last_step_is_kept(
    tmp_path: Path, launch: Launch
) -> None:
    plan = rr_plan(tmp_path)
    ckpt = tmp_path / "ckpt"
    common = [plan, "--model", MLP, "--no-progress", "--timeout", "30", "--checkpoint-dir", str(ckpt)]
    first = launch.plain(2, [*common, "--steps", "5", "--checkpoint-every", "2", "--lr", "0.1"])
    outs = [finish(p) for p in first]
    assert [code for code, _ in outs] == [0, 0], outs
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000004", "step-000005"]  # 5 kept, 2 pruned
    before = {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()}

    # another run (seed 7, lr 0.2) into the same directory: refused without --resume ...
    both = launch.plain(2, [*common, "--steps", "6", "--lr", "0.2", "--seed", "7"])
    outs = [finish(p) for p in both]
    assert [code for code, _ in outs] == [2, 2]
    assert_one_error_line(outs[0][1], f"checkpoint directory {ckpt} already holds checkpoints (steps up to 5")
    assert outs[1][1] == ""
    # ... and with --resume, because it is another run (the seed differs); the refusal comes
    # before any communication, so rank 0 alone shows it
    (seed7,) = launch.plain(2, [*common, "--steps", "6", "--lr", "0.2", "--seed", "7", "--resume"], ranks=[0])
    code, err = finish(seed7)
    assert code == 2
    assert_one_error_line(err, "holds another run (seed 0 (saved) != 7 (this run))")
    # another split resumes (checkpoints are keyed by qualified names), another optimizer is
    # refused in one line, not a state_dict error or KeyError
    split = rr_plan(tmp_path, layers=[[0, 1], [2, 3, 4, 5]], optimizer="momentum", name="split.json")
    (resplit,) = launch.plain(
        2, [split, *common[1:], "--steps", "6", "--resume", "--optimizer", "momentum"], ranks=[0]
    )
    code, err = finish(resplit)
    assert code == 2
    assert_one_error_line(err, "holds another run (optimizer 'sgd' (saved) != 'momentum' (this run))")
    assert {p: p.read_bytes() for p in ckpt.rglob("*") if p.is_file()} == before  # nothing clobbered

    # the same run resumes from step 5 (the final step of the first run), with a new lr
    resumed = launch.plain(
        2, [*common, "--steps", "7", "--lr", "0.05", "--resume", "--metrics", str(tmp_path / "m.json")]
    )
    outs = [finish(p) for p in resumed]
    assert [code for code, _ in outs] == [0, 0], outs
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["first_step"] == 5 and len(metrics["losses"]) == 2
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-000005", "step-000007"]  # final step saved
    assert leftovers(tmp_path) == []


@pytest.mark.multiprocess
def test_nan_loss_stops_the_run_naming_step_and_stage(tmp_path: Path, launch: Launch) -> None:
    plan = str(tmp_path / "plan.json")
    make_plan(NAN_MLP, [[0, 1, 2], [3, 4, 5]], [1, 1], "1f1b-flush", batch_size=8).save(plan)
    procs = launch.plain(
        2,
        [
            plan,
            "--model",
            NAN_MLP,
            "--steps",
            "5",
            "--no-progress",
            "--timeout",
            TIMEOUT_S,
            "--metrics",
            str(tmp_path / "m.json"),
        ],
    )
    outs = [finish(p) for p in procs]
    assert [code for code, _ in outs] == [2, 2]
    assert_one_error_line(
        outs[1][1],
        "rank 1: the loss is nan at step 1 (minibatch 0) on stage 1; pass --allow-nonfinite to train on",
    )
    # rank 0 learns it from the watchdog or from the closed connection, first come
    assert_one_error_line(outs[0][1], "rank 1")
    assert not (tmp_path / "m.json").exists()
    procs = launch.plain(
        2,
        [
            plan,
            "--model",
            NAN_MLP,
            "--steps",
            "2",
            "--no-progress",
            "--timeout",
            "30",
            "--metrics",
            str(tmp_path / "m.json"),
            "--allow-nonfinite",
        ],
    )
    assert [finish(p)[0] for p in procs] == [0, 0]
    metrics = read_json_object(tmp_path / "m.json")  # strict: no bare NaN
    assert metrics["losses"] == [None, None]


@pytest.mark.multiprocess
def test_metrics_write_failure_is_one_line_on_every_rank(tmp_path: Path, launch: Launch) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file")
    procs = launch.plain(
        2,
        [
            rr_plan(tmp_path),
            "--model",
            MLP,
            "--steps",
            "2",
            "--no-progress",
            "--timeout",
            TIMEOUT_S,
            "--metrics",
            str(blocker / "m.json"),
        ],
    )
    outs = [finish(p) for p in procs]
    assert [code for code, _ in outs] == [2, 2]
    assert_one_error_line(outs[0][1], f"cannot write {blocker / 'm.json'}: {blocker} is a file")
    assert_one_error_line(outs[1][1], "rank 1: another rank failed after training")
    assert leftovers(tmp_path) == []


def test_a_failed_store_call_of_the_main_thread_is_bounded() -> None:
    """The guard ends a main-thread store call that never returns (a stopped store host)."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    from pipeplan.runtime.failure import Watchdog

    port = free_port()
    master = dist.TCPStore(
        "127.0.0.1", port, is_master=True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    seen: list[str] = []
    done = threading.Event()

    def on_failure(message: str) -> None:
        seen.append(message)
        done.set()

    dog = Watchdog(0, 1, "127.0.0.1", port, interval_s=0.05, heartbeat_timeout_s=0.5, on_failure=on_failure)
    dog.start()

    class Stuck:
        def set(self, key: str, value: str) -> None:
            done.wait(5.0)  # blocks like a call to a SIGSTOPped store

    dog._main_store = Stuck()
    started = time.monotonic()
    dog.publish("loss/0", "1.0")
    assert done.is_set() and time.monotonic() - started < 3.0
    assert (
        seen[0].startswith("rank 0: the rendezvous store at 127.0.0.1:") and "has not answered for" in seen[0]
    )
    dog.stop()
    del master
    with pytest.raises(RuntimeFailure, match="cannot reach the rendezvous store"):
        Watchdog(0, 1, "127.0.0.1", free_port(), heartbeat_timeout_s=0.5)
